"""LoRA serving: what serving four adapters beside the base model costs, on core-serve and on
`vllm serve --enable-lora`, both measured by vLLM's own client (`vllm bench serve`) in one run.

Four random PEFT adapters of the default model (rank 8 and 16, every projection) are made in a
temporary folder (tools.lora_adapters) and served by each server with the same flags:
`--enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules a0=... a1=... a2=... a3=...`.
Workloads (seeded random token prompts, ignore_eos), each server one at a time:
- saturation, base model only: 64 prompts, 128 in / 64 out, rate inf;
- saturation, mixed: the same, requests naming a0, a1, a2, a3 and the base model in turn;
- batch 1, base model and batch 1 through a0: 8 prompts, 128 in / 128 out, one at a time.
Each workload draws its prompts with a seed of its own, so none hits another's prefix cache.
core-serve also runs the two base-model workloads without `--enable-lora`, for what the switch
costs requests without adapters. Ratios per server: mixed / base output tok/s (target >= 0.85 on core-serve), TPOT with an
adapter / without at batch 1 (target <= 1.2); and core-serve / vllm serve on each workload.
Results: benchmarks/results/lora[_quick].{json,md}.

    python -m benchmarks.serving.lora [--peer-python VENV/bin/python] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    core_serve,
    machine_info,
    machine_line,
    markdown_table,
    result_name,
    write_results,
)
from benchmarks.peers.vllm import vllm_serve
from benchmarks.peers.vllm_bench_client import BurstWorkload, run_bench_serve, summary
from benchmarks.serving.judged_comparison import (
    add_server_arguments,
    fmt,
    judge,
    ratio,
    resolve_server_arguments,
    targets_table,
)
from tools.lora_adapters import AdapterSpec, make_peft_adapter

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = tuple(
    AdapterSpec(
        f"a{index}", rank=8 if index % 2 == 0 else 16, target_modules=ALL_MODULES, seed=100 + index
    )  # fmt: skip
    for index in range(4)
)
MAX_LORA_RANK = 16
BASE_MODEL_NAME = "base"
CORE = "core-serve"
CORE_LORA_OFF = "core-serve without --enable-lora"
VLLM = "vllm serve"
BASE_WORKLOADS = ("saturation, base", "batch 1, base")
WORKLOAD_SEED_STRIDE = 1000
WARM_UP = BurstWorkload("warm-up", 4, 16, 2, float("inf"), lora_modules=("a0", "a1", "a2", "a3"))
BASE_WARM_UP = BurstWorkload("warm-up", 4, 16, 2, float("inf"))


def workloads(quick: bool) -> dict[str, BurstWorkload]:
    """The four workloads; `quick`: tiny ones for a smoke run."""
    prompts, input_len, output_len, single = (8, 32, 8, 2) if quick else (64, 128, 64, 8)
    mixed = (*(spec.name for spec in ADAPTERS), BASE_MODEL_NAME)
    single_len = 16 if quick else 128
    return {
        "saturation, base": BurstWorkload("saturation base", prompts, input_len, output_len,
                                          float("inf")),
        "saturation, 4 adapters + base": BurstWorkload(
            "saturation mixed", prompts, input_len, output_len, float("inf"), lora_modules=mixed
        ),
        "batch 1, base": BurstWorkload("batch1 base", single, single_len, single_len,
                                       float("inf"), max_concurrency=1),
        "batch 1, adapter a0": BurstWorkload(
            "batch1 adapter", single, single_len, single_len, float("inf"), max_concurrency=1,
            lora_modules=("a0",),
        ),
    }  # fmt: skip


def lora_flags(adapter_dir: Path) -> list[str]:
    """The same LoRA flags for both servers."""
    modules = [f"{spec.name}={adapter_dir / spec.name}" for spec in ADAPTERS]
    return ["--enable-lora", "--max-loras", str(len(ADAPTERS)),
            "--max-lora-rank", str(MAX_LORA_RANK), "--lora-modules", *modules]  # fmt: skip


def measure(
    url: str,
    args,
    work_dir: Path,
    names: tuple[str, ...] | None = None,
    warm_up: BurstWorkload = WARM_UP,
) -> dict:
    """The workloads `names` (None: every one) against the server at `url`: workload name ->
    the client's summary. A workload's seed is its place in `args.workloads`, whichever
    server runs it."""
    models = [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    if BASE_MODEL_NAME not in models:
        raise RuntimeError(f"the server serves {models}, not {BASE_MODEL_NAME!r}")
    tokenizer = args.hf_model
    run_bench_serve(args.peer_python, url, BASE_MODEL_NAME, tokenizer, warm_up, work_dir, 99)
    results = {}
    for index, (name, workload) in enumerate(args.workloads.items()):
        if names is not None and name not in names:
            continue
        print(f"  vllm bench serve: {name}: {workload.describe()}", flush=True)
        # A seed per workload: no workload's prompts hit another's prefix cache.
        seed = args.seed + WORKLOAD_SEED_STRIDE * index
        raw = run_bench_serve(
            args.peer_python, url, BASE_MODEL_NAME, tokenizer, workload, work_dir, seed
        )
        results[name] = summary(raw)
    return results


def run_servers(args, work_dir: Path) -> dict:
    adapter_dir = work_dir / "adapters"
    for spec in ADAPTERS:
        make_peft_adapter(args.hf_model, spec, adapter_dir / spec.name)
    flags = lora_flags(adapter_dir)
    results = {}
    print(f"{CORE} {' '.join(flags)}", flush=True)
    core_flags = ["--dtype", args.dtype, "--served-model-name", BASE_MODEL_NAME, *flags]
    with core_serve(core_flags, work_dir / "core-serve.log") as url:
        results[CORE] = measure(url, args, work_dir)
    print(CORE_LORA_OFF, flush=True)
    plain_flags = ["--dtype", args.dtype, "--served-model-name", BASE_MODEL_NAME]
    with core_serve(plain_flags, work_dir / "core-serve-plain.log") as url:
        results[CORE_LORA_OFF] = measure(url, args, work_dir, BASE_WORKLOADS, BASE_WARM_UP)
    if not args.skip_vllm:
        print(f"{VLLM} ({args.peer_python}); a minute or two to start", flush=True)
        with vllm_serve(args.peer_python, args.hf_model, args.dtype, args.threads,
                        BASE_MODEL_NAME, work_dir / "vllm-serve.log", flags) as url:  # fmt: skip
            results[VLLM] = measure(url, args, work_dir)
    return results


def cost_of_adapters(by_workload: dict) -> dict:
    """One server's two LoRA ratios: mixed / base output tok/s at saturation, and TPOT with an
    adapter / without at batch 1."""
    return {
        "saturation output tok/s, mixed / base": ratio(
            by_workload["saturation, 4 adapters + base"]["output_throughput"],
            by_workload["saturation, base"]["output_throughput"],
        ),
        "batch 1 TPOT p50, adapter / base": ratio(
            by_workload["batch 1, adapter a0"]["median_tpot_ms"],
            by_workload["batch 1, base"]["median_tpot_ms"],
        ),
    }


def cost_of_enabling_lora(servers: dict) -> dict:
    """What --enable-lora costs requests without adapters: the base workloads' figures on
    core-serve with it over without it."""
    on, off = servers[CORE], servers.get(CORE_LORA_OFF)
    if off is None:
        return {}
    return {
        "saturation output tok/s, base, LoRA on / off": ratio(
            on["saturation, base"]["output_throughput"],
            off["saturation, base"]["output_throughput"],
        ),
        "batch 1 TPOT p50, base, LoRA on / off": ratio(
            on["batch 1, base"]["median_tpot_ms"], off["batch 1, base"]["median_tpot_ms"]
        ),
    }


TARGETS = {
    "saturation output tok/s, mixed / base": (">=", 0.85),
    "batch 1 TPOT p50, adapter / base": ("<=", 1.2),
}


def targets(servers: dict) -> dict:
    """core-serve's two LoRA ratios against the issue's targets."""
    ratios = cost_of_adapters(servers[CORE])
    return {name: judge(ratios[name], sign, bound) for name, (sign, bound) in TARGETS.items()}


def render_markdown(result: dict) -> str:
    lines = ["# LoRA serving: four adapters beside the base model", "",
             machine_line(result["machine"]), "",
             f"Client: {result['client']}. Threads: {result['threads']} each. "
             f"dtype: {result['dtype']}. Adapters: {result['adapters']}. "
             f"Flags (both servers): `{result['flags']}`.", ""]  # fmt: skip
    lines += [f"- {name}: {description}" for name, description in result["workloads"].items()]
    lines.append("")
    servers = result["servers"]
    rows = []
    for workload in result["workloads"]:
        for server, by_workload in servers.items():
            if workload not in by_workload:
                continue
            s = by_workload[workload]
            rows.append([workload, server, fmt(s["output_throughput"]),
                         fmt(s["median_tpot_ms"], 2), fmt(s["median_ttft_ms"]),
                         f"{s['completed']} / {s['failed']}"])  # fmt: skip
    lines.append(markdown_table(
        ["workload", "server", "output tok/s", "TPOT p50 ms", "TTFT p50 ms", "completed / failed"],
        rows,
    ))  # fmt: skip
    lines += ["", "## What the adapters cost each server", ""]
    lines.append(markdown_table(["server", *TARGETS], [
        [server, *(fmt(v, 2) for v in cost_of_adapters(by_workload).values())]
        for server, by_workload in servers.items() if server != CORE_LORA_OFF
    ]))  # fmt: skip
    switch = cost_of_enabling_lora(servers)
    if switch:
        lines += ["", "## What --enable-lora costs requests without adapters (core-serve)", ""]
        lines.append(markdown_table(["ratio", "measured"],
                                    [[name, fmt(v, 2)] for name, v in switch.items()]))  # fmt: skip
    if VLLM in servers:
        lines += ["", "## core-serve / vllm serve", ""]
        lines.append(markdown_table(["workload", "output tok/s", "TPOT p50"], [
            [w, fmt(ratio(servers[CORE][w]["output_throughput"],
                           servers[VLLM][w]["output_throughput"]), 2),
             fmt(ratio(servers[CORE][w]["median_tpot_ms"], servers[VLLM][w]["median_tpot_ms"]), 2)]
            for w in result["workloads"]
        ]))  # fmt: skip
    lines += ["", "## Targets (core-serve)", "", targets_table(result["targets"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads")
    add_server_arguments(parser, "adapters, tokenizer, vllm serve")
    args = parser.parse_args(argv)
    resolve_server_arguments(parser, args)
    args.workloads = workloads(args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by core-serve's workers
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        servers = run_servers(args, Path(folder))
        flags = " ".join(lora_flags(Path("ADAPTERS")))
    result = {
        "benchmark": "lora",
        "machine": machine_info(),
        "client": f"vllm bench serve (vLLM {args.peer_version})",
        "threads": args.threads,
        "dtype": args.dtype,
        "adapters": ", ".join(f"{s.name} (rank {s.rank})" for s in ADAPTERS),
        "flags": flags,
        "workloads": {name: w.describe() for name, w in args.workloads.items()},
        "servers": servers,
        "targets": targets(servers),
        "cost_of_enabling_lora": cost_of_enabling_lora(servers),
    }
    write_results(result, render_markdown(result), args.output_dir,
                  result_name("lora", args.quick))  # fmt: skip
    print(render_markdown(result))
    failed = sum(s["failed"] or 0 for by_workload in servers.values() for s in by_workload.values())
    if failed:
        raise SystemExit(f"{failed} requests failed")


if __name__ == "__main__":
    main()
