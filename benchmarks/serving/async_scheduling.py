"""Async scheduling on and off: `core-serve` with and without `--async-scheduling`, measured by
vLLM's own client (`vllm bench serve`) in one run.

Engines: the GGUF file's blocks as shipped (`--quantization gguf`) and the dequantized path
(`--dtype DTYPE`: the weights dequantized to the engine's dtype), each started without and with
`--async-scheduling`, in the order off, on, off, on (`PASSES` passes), so that a drift of the
machine's speed during the run shows up as a difference between passes rather than between
settings. Workloads are one_user.py's: one user (8 prompts, 128 in / 128 out, one at a time,
median of the rounds' p50) and saturation (64 prompts, 128 in / 64 out, all at once).
Ratios: on / off for TPOT (one user) and output tok/s (saturation), each pass's and their
median. Greedy completions (one_user.py's prompts, 32 tokens, temperature 0) are compared
between on and off: they must be identical.
Results: benchmarks/results/async_scheduling[_quick].{json,md}.

    python -m benchmarks.serving.async_scheduling [--peer-python VENV/bin/python] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.common import (
    core_serve,
    machine_info,
    machine_line,
    markdown_table,
    result_name,
    write_results,
)
from benchmarks.serving.judged_comparison import (
    add_server_arguments,
    fmt,
    ratio,
    resolve_server_arguments,
)
from benchmarks.serving.one_user import (
    ONE_USER,
    QUICK_ONE_USER,
    QUICK_SATURATION,
    ROUNDS,
    SATURATION,
    greedy_completions,
    measure,
)

# Engine name -> its arguments; "--dtype" is followed by the run's dtype (an explicit dtype
# keeps the dequantized path, the default for a GGUF file being its blocks on AVX2 builds).
ENGINES = {"gguf": ["--quantization", "gguf"], "dequantized": ["--dtype"]}
PASSES = 2
SETTINGS = {"off": [], "on": ["--async-scheduling"]}


def engine_arguments(engine: str, dtype: str) -> list[str]:
    arguments = ENGINES[engine]
    return [*arguments, dtype] if arguments[-1:] == ["--dtype"] else arguments


def run_engine(args, work_dir: Path, engine: str) -> dict:
    """Every pass of one engine: {"passes": [{"off": results, "on": results}, ...],
    "identical_greedy": bool}."""
    workloads = {"one user": args.one_user, "saturation": args.saturation}
    passes, texts = [], {}
    for pass_index in range(args.passes):
        measured = {}
        for setting, flags in SETTINGS.items():
            argv = [*engine_arguments(engine, args.dtype), *flags]
            print(f"core-serve {' '.join(argv)} (pass {pass_index + 1})", flush=True)
            log = work_dir / f"{engine}-{setting}-{pass_index}.log"
            with core_serve(argv, log) as url:
                if pass_index == 0:
                    texts[setting] = greedy_completions(url)
                measured[setting] = measure(url, args, work_dir, workloads, args.rounds)
        passes.append(measured)
    return {"passes": passes, "identical_greedy": texts["on"] == texts["off"]}


def summary_figure(measured: dict, setting: str, workload: str, key: str) -> float | None:
    return measured[setting][workload]["summary"].get(key)


def pass_ratios(measured: dict) -> dict[str, float | None]:
    """on / off of one pass: one user's TPOT and TTFT, saturation's output tok/s."""
    return {
        "TPOT p50, one user": ratio(
            summary_figure(measured, "on", "one user", "median_tpot_ms"),
            summary_figure(measured, "off", "one user", "median_tpot_ms"),
        ),
        "TTFT p50, one user": ratio(
            summary_figure(measured, "on", "one user", "median_ttft_ms"),
            summary_figure(measured, "off", "one user", "median_ttft_ms"),
        ),
        "output tok/s, saturation": ratio(
            summary_figure(measured, "on", "saturation", "output_throughput"),
            summary_figure(measured, "off", "saturation", "output_throughput"),
        ),
    }


def median_ratios(passes: list[dict]) -> dict[str, float | None]:
    per_pass = [pass_ratios(measured) for measured in passes]
    medians = {}
    for name in per_pass[0]:
        values = [r[name] for r in per_pass if r[name] is not None]
        medians[name] = statistics.median(values) if values else None
    return medians


def render_markdown(result: dict) -> str:
    lines = ["# Async scheduling on and off: core-serve under vllm bench serve", "",
             machine_line(result["machine"]), "",
             f"Client: {result['client']}. Threads: {result['threads']}. Engine dtype of the "
             f"dequantized path: {result['dtype']}. Settings alternate off, on, off, on "
             f"({result['passes_per_engine']} passes per engine)."]  # fmt: skip
    for engine, engine_result in result["engines"].items():
        lines += ["", f"## core-serve {' '.join(engine_arguments(engine, result['dtype']))}", ""]
        rows = []
        for index, measured in enumerate(engine_result["passes"]):
            for setting in SETTINGS:
                one = measured[setting]["one user"]["summary"]
                sat = measured[setting]["saturation"]["summary"]
                rows.append([str(index + 1), setting, fmt(one["median_tpot_ms"], 2),
                             fmt(one["median_ttft_ms"]), fmt(sat["output_throughput"]),
                             f"{one['failed'] + sat['failed']}"])  # fmt: skip
        lines.append(markdown_table(
            ["pass", "async scheduling", "one user TPOT p50 ms", "one user TTFT p50 ms",
             "saturation output tok/s", "failed"], rows))  # fmt: skip
        ratios = engine_result["median_ratios"]
        lines += ["", "On / off, median over the passes: " + ", ".join(
            f"{name} {fmt(value, 2)}" for name, value in ratios.items()) + "."]  # fmt: skip
        same = "identical" if engine_result["identical_greedy"] else "NOT identical"
        lines.append(f"Greedy completions with it on and off: {same}.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads, one pass")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(ENGINES))
    add_server_arguments(parser, "tokenizer")
    args = parser.parse_args(argv)
    resolve_server_arguments(parser, args)
    args.rounds = 1 if args.quick else ROUNDS
    args.passes = 1 if args.quick else PASSES
    args.one_user = QUICK_ONE_USER if args.quick else ONE_USER
    args.saturation = QUICK_SATURATION if args.quick else SATURATION
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by core-serve's workers
    engines = {}
    with tempfile.TemporaryDirectory(prefix="async-scheduling-") as folder:
        for engine in args.engines:
            engines[engine] = run_engine(args, Path(folder), engine)
            engines[engine]["median_ratios"] = median_ratios(engines[engine]["passes"])
    result = {
        "benchmark": "async_scheduling",
        "machine": machine_info(),
        "client": f"vllm bench serve (vLLM {args.peer_version})",
        "threads": args.threads,
        "dtype": args.dtype,
        "passes_per_engine": args.passes,
        "engines": engines,
    }
    write_results(result, render_markdown(result), args.output_dir,
                  result_name("async_scheduling", args.quick))  # fmt: skip
    print(render_markdown(result))
    if not all(e["identical_greedy"] for e in engines.values()):
        raise SystemExit("greedy completions differ between async scheduling on and off")


if __name__ == "__main__":
    main()
