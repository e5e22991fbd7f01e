"""Speculative decoding: per-token latency and throughput with and without drafts, greedy.

Two workloads (`benchmarks/spec_decode/workloads.py`): copy-heavy chats through the model's chat
template (renaming a variable, sorting a list, reformatting SQL and JSON, fixing spelling,
quoting a paragraph, a list to a table, CSV to JSON), where drafting from the request's own
tokens pays, and random-word prompts run to max_tokens, where it finds little. Each runs in
closed loop (`benchmarks/harness/closed_loop.py`) at batch 1, 4, 16 and saturation (every prompt at
once) on an engine without speculation and one per speculative config (ngram K=4, n-grams
2..4 by default; `--methods ngram suffix`, `--speculative-config JSON` to replace a method's
config). All engines are up at once and each run of an arm follows the baseline's run of the
same workload and batch, so every ratio compares runs seconds apart. A suffix-decoding engine
is restarted before each run: its tree of earlier outputs must not hold an earlier run's
replies to the same prompts.

Reported per row: output tok/s and TPOT against the baseline, the acceptance rate and mean
accepted length (the engine's spec_decode counters), and the requests whose tokens differ from
the baseline's: greedy speculation must change none, and the script exits with status 1 when
the engine's do (after writing the results).

With `--peer vllm`, vLLM (its own Python, `benchmarks/peers/vllm_spec_decode_runner.py`) runs the same
token ids after the engines have stopped: without speculation, then with each config as its
`speculative_config`, one process at a time; a config vLLM refuses is recorded with its error.

    python -m benchmarks.spec_decode.bench [--quick] [--methods ngram suffix] [--peer vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.harness.common import (
    default_hf_folder,
    default_num_threads,
    device_results_dir,
    engine_default_dtype,
    machine_info,
    result_name,
    write_results,
)
from benchmarks.harness.engine_arm import WARM_UP_MAX_TOKENS, WARM_UP_PROMPT, EngineArm
from benchmarks.spec_decode.report import (
    BASELINE,
    SATURATION,
    Measurement,
    build_rows,
    engine_targets,
    num_differing_requests,
    render_markdown,
)
from benchmarks.spec_decode.workloads import (
    FULL_SHAPE,
    QUICK_SHAPE,
    WORKLOAD_NAMES,
    DecodeWorkload,
    build_workloads,
    num_prompts_for,
)
from core_engine.common.dtypes import DTYPE_NAMES
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.speculative_config import SPECULATIVE_METHODS, SpeculativeConfig

DEFAULT_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4,
              "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
}  # fmt: skip
FULL_BATCH_SIZES = ("1", "4", "16", SATURATION)
QUICK_BATCH_SIZES = ("1", "4", SATURATION)
MIN_PROMPTS_PER_RUN = 8  # a batch-1 run covers every chat task once
ROUNDS_PER_RUN = 2  # a batch-b run sends 2b prompts: each slot is refilled once
DEFAULT_KV_CACHE_GIB = 2.0
KV_CACHE_ENV = "CORE_ENGINE_KV_CACHE_MEMORY_BYTES"


# ---- the plan --------------------------------------------------------------------------------


def run_plan(
    workload: DecodeWorkload, batch_sizes: list[str], min_prompts: int = MIN_PROMPTS_PER_RUN
) -> list[tuple[str, int, int]]:
    """(batch label, concurrency, prompts sent) per batch size, for one workload."""
    plan = []
    for batch in batch_sizes:
        concurrency = None if batch == SATURATION else int(batch)
        num_prompts = num_prompts_for(
            workload.num_prompts, concurrency, min_prompts, ROUNDS_PER_RUN
        )
        plan.append((batch, concurrency or num_prompts, num_prompts))
    return plan


def speculative_configs(methods: list[str], overrides: list[str]) -> dict[str, dict]:
    """{arm label (the method): vLLM-style config dict}: the default config of each method in
    `methods`, replaced (or added) by each JSON override of the same method. ValueError
    naming the field when an override is not a valid config."""
    configs = {method: DEFAULT_CONFIGS[method] for method in methods}
    for text in overrides:
        config = SpeculativeConfig.parse(text)  # validates; ValueError names the field
        configs[config.method] = json.loads(text)
    return configs


# ---- the engine ------------------------------------------------------------------------------


def engine_config(args: argparse.Namespace, speculative_config: dict | None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        speculative_config=speculative_config,
    )


async def measure_engine(
    args: argparse.Namespace, configs: dict[str, dict]
) -> tuple[list[DecodeWorkload], DecodeWorkload, list[Measurement]]:
    """Starts every arm, builds the workloads with the baseline's tokenizer, and runs every
    (repeat, workload, batch), each arm right after the baseline. Returns the workloads,
    the warm-up workload (for peers) and the measurements."""
    arms = [EngineArm(BASELINE, engine_config(args, None))] + [
        EngineArm(label, engine_config(args, config), fresh_per_run=config["method"] == "suffix")
        for label, config in configs.items()
    ]
    measurements = []
    try:
        for arm in arms:
            print(f"starting the engine: {arm.label}")
            await arm.start()
        client = arms[0].client
        shape = QUICK_SHAPE if args.quick else FULL_SHAPE
        workloads = build_workloads(
            args.workloads, shape, client.apply_chat_template, client.tokenize, args.seed
        )
        warm_up = DecodeWorkload("warm-up", "", [client.tokenize(WARM_UP_PROMPT)],
                                 WARM_UP_MAX_TOKENS, ignore_eos=False)  # fmt: skip
        for repeat in range(args.repeats):
            for workload in workloads:
                for batch, concurrency, num_prompts in run_plan(
                    workload, args.batch_sizes, args.min_prompts
                ):
                    for arm in arms:
                        run, counts = await arm.run(workload, num_prompts, concurrency)
                        measurement = Measurement("engine", arm.label, workload.name, batch,
                                                  concurrency, repeat, run, counts)  # fmt: skip
                        print_measurement(measurement)
                        measurements.append(measurement)
    finally:
        for arm in arms:
            await arm.close()
    return workloads, warm_up, measurements


def print_measurement(m: Measurement) -> None:
    summary = m.run.summary()
    accepted = m.counts.mean_acceptance_length
    print(
        f"{m.side} {m.arm:8} {m.workload} batch {m.batch} (x{m.concurrency}, "
        f"{summary['num_requests']} requests): {summary['output_tokens_per_s']:.1f} tok/s, "
        f"TPOT {summary['tpot_ms']['mean']:.1f} ms"
        + (f", mean accepted length {accepted:.2f}" if accepted is not None else ""),
        flush=True,
    )


# ---- vLLM ------------------------------------------------------------------------------------


def measure_vllm(
    args: argparse.Namespace,
    configs: dict[str, dict],
    workloads: list[DecodeWorkload],
    warm_up: DecodeWorkload,
    dtype: str,
    work_dir: Path,
) -> tuple[list[Measurement], dict[str, dict]]:
    """vLLM without speculation, then with each config, one process at a time. Returns the
    measurements and, per arm, its record (`describe`) or {"error": what vLLM said}."""
    from benchmarks.harness.peer_process import PeerError
    from benchmarks.peers.vllm_spec_decode_arm import VllmSpecDecodeArm

    hf_folder = args.hf_model or default_hf_folder(args.model)
    measurements: list[Measurement] = []
    records: dict[str, dict] = {}
    for label, config in [(BASELINE, None), *configs.items()]:
        try:
            arm = VllmSpecDecodeArm(
                label, args.peer_python, hf_folder, dtype, default_num_threads(), config,
                workloads, warm_up, work_dir, seed=args.seed,
            )  # fmt: skip
        except PeerError as exc:
            records[label] = failure_record(config, exc)
            print(f"vLLM ({label}) did not start: {records[label]['error']}")
            continue
        try:
            measurements += run_vllm_arm(arm, args, workloads)
            records[label] = arm.describe()
        except PeerError as exc:
            records[label] = failure_record(config, exc)
            print(f"vLLM ({label}) failed: {records[label]['error']}")
        finally:
            arm.close()
    return measurements, records


def run_vllm_arm(arm, args: argparse.Namespace, workloads: list[DecodeWorkload]) -> list:
    measurements = []
    for repeat in range(args.repeats):
        for workload in workloads:
            for batch, concurrency, num_prompts in run_plan(
                workload, args.batch_sizes, args.min_prompts
            ):
                run, counts = arm.run(workload, num_prompts, concurrency)
                measurement = Measurement("vllm", arm.label, workload.name, batch,
                                          concurrency, repeat, run, counts)  # fmt: skip
                print_measurement(measurement)
                measurements.append(measurement)
    return measurements


def failure_record(config: dict | None, error: Exception) -> dict:
    """The error vLLM's runner reported, on one line (for a table), and the log tail apart."""
    message, _, tail = str(error).partition("; log tail:\n")
    return {"speculative_config": config, "error": " ".join(message.split()), "log_tail": tail}


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, a minute or two")
    parser.add_argument("--model", default=None,
                        help="engine model (default: SmolLM2 GGUF; 'null' runs the plumbing)")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                        help="every side's dtype (default: the engine's for the device)")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=SPECULATIVE_METHODS,
                        help="speculative methods, each with its default config (default: ngram)")  # fmt: skip
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON",
                        help="a config replacing its method's default (adds the method); "
                        "repeatable")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOAD_NAMES),
                        choices=WORKLOAD_NAMES)  # fmt: skip
    parser.add_argument("--batch-sizes", nargs="+", default=None,
                        help=f"requests in flight, or '{SATURATION}' for every prompt at once "
                        f"(default: {' '.join(FULL_BATCH_SIZES)}; --quick "
                        f"{' '.join(QUICK_BATCH_SIZES)})")  # fmt: skip
    parser.add_argument("--min-prompts", type=int, default=MIN_PROMPTS_PER_RUN,
                        help="prompts a small-batch run sends at least (default "
                        f"{MIN_PROMPTS_PER_RUN}: every chat task once; 32: every chat)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every arm per workload and batch; medians reported")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help=f"each engine's CPU KV cache, the same for every arm, since all "
                        f"are up at once (default: ${KV_CACHE_ENV} where set, else "
                        f"{DEFAULT_KV_CACHE_GIB:g})")  # fmt: skip
    parser.add_argument("--peer", choices=("vllm",), default=None,
                        help="also run vLLM with and without the same configs")  # fmt: skip
    parser.add_argument("--peer-python", default=None,
                        help="vLLM's Python (default: $VLLM_PYTHON or /work/vllm-venv/bin/python)")  # fmt: skip
    parser.add_argument("--hf-model", type=Path, default=None,
                        help="the engine's weights as an HF folder, for vLLM")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default: benchmarks/results/<this CPU's SIMD kind>/ (gpu/ on cuda)")  # fmt: skip
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the defaults that depend on other flags; parser.error for a bad value."""
    args.batch_sizes = args.batch_sizes or list(
        QUICK_BATCH_SIZES if args.quick else FULL_BATCH_SIZES
    )
    for batch in args.batch_sizes:
        if batch != SATURATION and not (batch.isdigit() and int(batch) >= 1):
            parser.error(f"--batch-sizes takes integers >= 1 or '{SATURATION}', got {batch!r}")
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    if args.min_prompts < 1:
        parser.error(f"--min-prompts must be >= 1, got {args.min_prompts}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        parser.error(f"--kv-cache-gib must be positive, got {args.kv_cache_gib}")
    try:
        args.configs = speculative_configs(
            list(dict.fromkeys(args.methods)), args.speculative_config
        )
    except ValueError as exc:
        parser.error(f"--speculative-config: {exc}")
    if args.peer == "vllm":
        if args.model == "null":
            parser.error("--peer vllm needs a real model: vLLM has no null model")
        from benchmarks.peers.vllm import default_peer_python, vllm_version

        args.peer_python = args.peer_python or default_peer_python()
        try:
            vllm_version(args.peer_python)
        except ValueError as exc:
            parser.error(str(exc))
    if args.output_dir is None:
        args.output_dir = device_results_dir(args.device)


def main() -> None:
    args = parse_args()
    machine = machine_info()
    if args.kv_cache_gib is not None or KV_CACHE_ENV not in os.environ:  # the workers read it
        os.environ[KV_CACHE_ENV] = str(int((args.kv_cache_gib or DEFAULT_KV_CACHE_GIB) * 2**30))
    dtype = args.dtype or engine_default_dtype(args.device)
    workloads, warm_up, measurements = asyncio.run(measure_engine(args, args.configs))
    vllm_records: dict[str, dict] = {}
    if args.peer == "vllm":
        with tempfile.TemporaryDirectory(prefix="bench-spec-decode-") as work_dir:
            vllm_measurements, vllm_records = measure_vllm(
                args, args.configs, workloads, warm_up, dtype, Path(work_dir)
            )
        measurements += vllm_measurements
    result = build_result(args, machine, dtype, workloads, measurements, vllm_records)
    name = result_name("spec_decode", args.quick)
    path = write_results(result, render_markdown(result), args.output_dir, name)
    print(render_markdown(result))
    print(f"results: {path} and {path.with_suffix('.md')}")
    if result["num_differing_requests_engine"]:
        sys.exit(f"equality gate failed: {result['num_differing_requests_engine']} requests differ")


def build_result(args, machine, dtype, workloads, measurements, vllm_records) -> dict:
    rows = build_rows(measurements)
    return {
        "benchmark": "spec_decode",
        "quick": args.quick,
        "machine": machine,
        "device": args.device,
        "dtype": dtype,
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 GGUF (default)",
        "num_threads": default_num_threads(),
        "kv_cache_bytes": int(os.environ[KV_CACHE_ENV]),
        "speculative_configs": args.configs,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "seed": args.seed,
        "workloads": [
            {
                "name": w.name,
                "description": w.description,
                "num_prompts": w.num_prompts,
                "num_prompt_tokens": sum(map(len, w.prompt_token_ids)),
                "max_tokens": w.max_tokens,
                "ignore_eos": w.ignore_eos,
                "runs": [list(step) for step in run_plan(w, args.batch_sizes, args.min_prompts)],
            }
            for w in workloads
        ],  # fmt: skip
        "vllm": vllm_records,
        "rows": rows,
        "targets": engine_targets(rows),
        "num_differing_requests_engine": num_differing_requests(rows, "engine"),
        "num_differing_requests_vllm": num_differing_requests(rows, "vllm"),
    }


if __name__ == "__main__":
    main()
