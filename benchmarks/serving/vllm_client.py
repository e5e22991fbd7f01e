"""`bench_serving --client vllm`: vLLM's own client against `core-serve`, then `vllm serve`.

The same seeded workloads of `vllm bench serve` (benchmarks/peers/vllm_bench_client.py: saturation,
64 prompts of 128 random tokens, 64 out, all at once; 32 prompts at 2 requests/s; one stream)
go to `core-serve` and then to vLLM's OpenAI server on the same weights, one server loaded at a
time, each with the same dtype and threads. Both result blocks are kept whole, and the report
gives engine / vLLM ratios of output tok/s, TTFT, TPOT and ITL (below 1 is better for the
latencies). Results: benchmarks/results/serving_vllm_client[_quick].{json,md}.
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    core_serve,
    default_hf_folder,
    default_num_threads,
    engine_default_dtype,
    machine_info,
    machine_line,
    markdown_table,
    result_name,
    write_results,
)
from benchmarks.peers.vllm_bench_client import (
    FIGURES,
    WORKLOADS,
    BurstWorkload,
    run_bench_serve,
    summary,
)

QUICK_WORKLOADS = (
    BurstWorkload("saturation", 16, 128, 16, float("inf")),
    BurstWorkload("2 requests/s", 8, 128, 16, 2.0),
)


def run_workloads(
    peer_python: str, url: str, tokenizer: Path, workloads, work_dir: Path, seed: int
) -> dict[str, dict]:
    """Each workload once against the server at `url`, after a two-request warm-up."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    warm_up = BurstWorkload("warm-up", 2, 16, 2, float("inf"))
    run_bench_serve(peer_python, url, model, tokenizer, warm_up, work_dir, seed)
    results = {}
    for workload in workloads:
        print(f"  vllm bench serve: {workload.describe()}", flush=True)
        raw = run_bench_serve(peer_python, url, model, tokenizer, workload, work_dir, seed)
        results[workload.name] = {"summary": summary(raw), "raw": raw}
    return results


def ratios(ours: dict[str, dict], theirs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Engine / vLLM per workload and figure (None where a figure is missing or zero)."""
    table = {}
    for name, result in ours.items():
        mine, peer = result["summary"], theirs[name]["summary"]
        table[name] = {
            key: (mine[key] / peer[key] if mine.get(key) and peer.get(key) else None)
            for key, _, _ in FIGURES
        }
    return table


def main(args: argparse.Namespace) -> None:
    from benchmarks.peers.vllm import vllm_serve

    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    num_threads = args.threads or default_num_threads()
    dtype = args.dtype or engine_default_dtype("cpu")
    hf_folder = args.hf_model or default_hf_folder(None)
    engine_flags = [*shlex.split(args.server_args), "--dtype", dtype]
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # inherited by core-serve's worker
    with tempfile.TemporaryDirectory(prefix="serving-vllm-client-") as folder:
        work_dir = Path(folder)
        print(f"core-serve {' '.join(engine_flags)}")
        with core_serve(engine_flags, work_dir / "server.log") as url:
            ours = run_workloads(args.peer_python, url, hf_folder, workloads, work_dir, args.seed)
        print(f"vllm serve ({args.peer_python}, {dtype}); it takes a minute or two to start")
        with vllm_serve(
            args.peer_python, hf_folder, dtype, num_threads, hf_folder.name,
            work_dir / "vllm-serve.log",
        ) as url:  # fmt: skip
            theirs = run_workloads(args.peer_python, url, hf_folder, workloads, work_dir, args.seed)
    result = {
        "benchmark": "serving_vllm_client",
        "machine": machine_info(),
        "client": f"vllm bench serve (vLLM {args.peer_version}, {args.peer_python})",
        "server": f"core-serve {' '.join(engine_flags)}",
        "peer": f"vLLM {args.peer_version} OpenAI server on {hf_folder.name}, {dtype}",
        "num_threads": num_threads,
        "workloads": {w.name: w.describe() for w in workloads},
        "engine": ours,
        "vllm": theirs,
        "ratios": ratios(ours, theirs),
    }
    name = result_name("serving_vllm_client", args.quick)
    write_results(result, render_markdown(result), args.output_dir, name)
    failed = sum(r["summary"]["failed"] or 0 for side in (ours, theirs) for r in side.values())
    print(f"failed requests: {failed} (must be 0)")


def render_markdown(result: dict) -> str:
    lines = [
        "# Serving under vLLM's own client: core-serve vs vllm serve",
        "",
        machine_line(result["machine"]),
        "",
        f"Client: {result['client']}. Engine: {result['server']}. Peer: {result['peer']}. "
        f"Threads: {result['num_threads']} each.",
    ]
    for name, description in result["workloads"].items():
        ours, theirs = result["engine"][name]["summary"], result["vllm"][name]["summary"]
        rows = [
            [label, _fmt(ours[key]), _fmt(theirs[key]), _fmt(result["ratios"][name][key], 2)]
            for key, label, _ in FIGURES
        ]
        rows.append(["completed / failed", f"{ours['completed']} / {ours['failed']}",
                     f"{theirs['completed']} / {theirs['failed']}", ""])  # fmt: skip
        lines += ["", f"## {name}: {description}", ""]
        lines.append(markdown_table(["", "engine", "vLLM", "engine / vLLM"], rows))
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
