"""One user at a time and a burst: core-serve beside llama-server and vllm serve, all measured by
vLLM's own client (`vllm bench serve`) in one run.

Servers, one loaded at a time, each given the same CPU threads:
- `core-serve --dtype DTYPE`: the GGUF file's weights dequantized to DTYPE at load (an
  explicit dtype keeps that path);
- `core-serve --quantization gguf` (the file's blocks as shipped, gguf_matmul.c; the default
  for a GGUF file on an AVX2 build since it won both workloads here);
- llama.cpp's `llama-server` on the same GGUF file, one slot (`--llama-server PATH`);
- `vllm serve` on the same weights as an HF folder, in the engine's default dtype.
Workloads (seeded random token prompts, ignore_eos):
- "one user": 8 prompts of 128 tokens, 128 out, `--max-concurrency 1`, run ROUNDS times with
  different seeds (the same seeds for every server, so no round hits another's prefix cache);
  reported as the median over the rounds of each round's p50;
- "saturation": 64 prompts, 128 in / 64 out, all at once (not llama-server: it has one slot).
Ratios: TPOT of `core-serve --quantization gguf` over llama-server's (target <= 0.8), its TTFT
over the dequantized core-serve's (target <= 1), its saturation output tok/s over vllm serve's (target
>= 1.5). Greedy agreement: the same prompts, 32 tokens at temperature 0, to the quantized
core-serve and llama-server; identical completions are counted (reported, not asserted).
Results: benchmarks/results/one_user[_quick].{json,md}.

    python -m benchmarks.serving.one_user --llama-server PATH [--peer-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
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
from benchmarks.peers.llama_server import LlamaServerPeer, find_llama_server
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
from core_engine.common.model_files import resolve_model_path

ONE_USER = BurstWorkload("one user", 8, 128, 128, float("inf"), max_concurrency=1)
SATURATION = BurstWorkload("saturation", 64, 128, 64, float("inf"))
QUICK_ONE_USER = BurstWorkload("one user", 2, 32, 16, float("inf"), max_concurrency=1)
QUICK_SATURATION = BurstWorkload("saturation", 8, 32, 8, float("inf"))
WARM_UP = BurstWorkload("warm-up", 2, 16, 2, float("inf"))
ROUNDS = 3
AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nWhat is a paged KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "List five prime numbers:",
    "Water boils at",
    "The quick brown fox",
)
AGREEMENT_TOKENS = 32
CORE_DEQUANTIZED = "core-serve --dtype"  # + the engine dtype: the weights dequantized
CORE_GGUF = "core-serve --quantization gguf"
LLAMA_SERVER = "llama-server"
VLLM = "vllm serve"


def measure(url: str, args, work_dir: Path, workloads: dict[str, BurstWorkload], rounds: int):
    """The workloads against the server at `url`: the one-user one `rounds` times (seeds
    seed, seed + 1, ...), the others once. name -> {"summary", "rounds"}."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    tokenizer = args.hf_model
    run_bench_serve(args.peer_python, url, model, tokenizer, WARM_UP, work_dir, args.seed + 99)
    results = {}
    for name, workload in workloads.items():
        repeats = rounds if workload.max_concurrency == 1 else 1
        summaries = []
        for round_index in range(repeats):
            print(
                f"  vllm bench serve: {workload.describe()} (round {round_index + 1})", flush=True
            )
            raw = run_bench_serve(
                args.peer_python, url, model, tokenizer, workload, work_dir, args.seed + round_index
            )
            summaries.append(summary(raw))
        results[name] = {"summary": median_summary(summaries), "rounds": summaries}
    return results


def median_summary(summaries: list[dict]) -> dict:
    """Each figure's median over the rounds; failed requests summed."""
    merged = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s.get(key) is not None]
        if key in ("failed", "completed"):
            merged[key] = sum(values)
        else:
            merged[key] = statistics.median(values) if values else None
    return merged


def greedy_completions(url: str) -> list[str]:
    """Each agreement prompt's greedy completion (temperature 0) from the server at `url`."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    texts = []
    with httpx.Client(timeout=300) as client:
        for prompt in AGREEMENT_PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": AGREEMENT_TOKENS,
                    "temperature": 0.0}  # fmt: skip
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            texts.append(response.json()["choices"][0]["text"])
    return texts


def agreement(ours: list[str], theirs: list[str]) -> dict:
    """How many completions are identical, and the mean share of each one's common prefix."""
    shares = []
    for a, b in zip(ours, theirs, strict=True):
        common = len(os.path.commonprefix([a, b]))
        shares.append(common / max(len(a), len(b), 1))
    identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {
        "identical": identical,
        "total": len(ours),
        "mean_common_prefix": statistics.mean(shares),
    }


def run_servers(args, work_dir: Path) -> tuple[dict, dict]:
    """Every server in turn; (results by server, greedy completions by server)."""
    both = {"one user": args.one_user, "saturation": args.saturation}
    engine = ["--dtype", args.dtype]
    results, texts = {}, {}
    print(f"{CORE_DEQUANTIZED} {args.dtype}", flush=True)
    with core_serve(engine, work_dir / "core-serve.log") as url:
        results[CORE_DEQUANTIZED] = measure(url, args, work_dir, both, args.rounds)
    print(CORE_GGUF, flush=True)
    with core_serve(["--quantization", "gguf"], work_dir / "core-serve-gguf.log") as url:
        texts[CORE_GGUF] = greedy_completions(url)
        results[CORE_GGUF] = measure(url, args, work_dir, both, args.rounds)
    if args.llama_server is not None:
        print(f"{LLAMA_SERVER} ({args.llama_server}), one slot", flush=True)
        peer = LlamaServerPeer(args.llama_server, args.gguf, args.threads, 1, work_dir)
        with contextlib.closing(peer):
            texts[LLAMA_SERVER] = greedy_completions(peer.url)
            results[LLAMA_SERVER] = measure(
                peer.url, args, work_dir, {"one user": args.one_user}, args.rounds
            )
    if not args.skip_vllm:
        print(f"{VLLM} ({args.peer_python}, {args.dtype}); a minute or two to start", flush=True)
        with vllm_serve(args.peer_python, args.hf_model, args.dtype, args.threads,
                        args.hf_model.name, work_dir / "vllm-serve.log") as url:  # fmt: skip
            results[VLLM] = measure(url, args, work_dir, both, args.rounds)
    return results, texts


def figure(results: dict, server: str, workload: str, key: str) -> float | None:
    return results.get(server, {}).get(workload, {}).get("summary", {}).get(key)


def targets(results: dict) -> dict:
    """The issue's three ratios, each with its target and whether it is met (None: a server
    was not measured)."""
    rows = {
        "TPOT p50, one user: gguf / llama-server": (
            ratio(figure(results, CORE_GGUF, "one user", "median_tpot_ms"),
                  figure(results, LLAMA_SERVER, "one user", "median_tpot_ms")), "<=", 0.8),
        "TTFT p50, one user: gguf / dequantized core-serve": (
            ratio(figure(results, CORE_GGUF, "one user", "median_ttft_ms"),
                  figure(results, CORE_DEQUANTIZED, "one user", "median_ttft_ms")), "<=", 1.0),
        "output tok/s, saturation: gguf / vllm serve": (
            ratio(figure(results, CORE_GGUF, "saturation", "output_throughput"),
                  figure(results, VLLM, "saturation", "output_throughput")), ">=", 1.5),
    }  # fmt: skip
    return {name: judge(value, sign, bound) for name, (value, sign, bound) in rows.items()}


def render_markdown(result: dict) -> str:
    lines = ["# One user and a burst: core-serve, llama-server, vllm serve", "",
             machine_line(result["machine"]), "",
             f"Client: {result['client']}. Threads: {result['threads']} each. "
             f"Engine dtype: {result['dtype']}. {result['notes']}"]  # fmt: skip
    for workload, description in result["workloads"].items():
        rows = []
        for server, by_workload in result["servers"].items():
            if workload not in by_workload:
                continue
            s = by_workload[workload]["summary"]
            rows.append([server, fmt(s["median_tpot_ms"], 2), fmt(s["median_ttft_ms"]),
                         fmt(s["output_throughput"]), f"{s['completed']} / {s['failed']}"])  # fmt: skip
        lines += ["", f"## {workload}: {description}", ""]
        lines.append(markdown_table(
            ["server", "TPOT p50 ms", "TTFT p50 ms", "output tok/s", "completed / failed"], rows
        ))  # fmt: skip
    lines += ["", "## Targets", "", targets_table(result["targets"])]
    if result.get("agreement"):
        a = result["agreement"]
        lines += ["", f"Greedy agreement, {AGREEMENT_TOKENS} tokens at temperature 0: "
                  f"{a['identical']} of {a['total']} completions identical between "
                  f"`{CORE_GGUF}` and llama-server (mean common prefix "
                  f"{100 * a['mean_common_prefix']:.0f}%)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads, one round")
    parser.add_argument("--llama-server", default=None,
                        help="llama.cpp's llama-server program (default: the one on PATH; "
                        "none: leave it out)")  # fmt: skip
    add_server_arguments(parser, "tokenizer, vllm serve")
    args = parser.parse_args(argv)
    resolve_server_arguments(parser, args)
    try:
        args.llama_server = find_llama_server(args.llama_server)
    except ValueError:
        args.llama_server = None  # no llama-server here: the run says so and goes on
    args.gguf = resolve_model_path(None)
    args.rounds = 1 if args.quick else ROUNDS
    args.one_user = QUICK_ONE_USER if args.quick else ONE_USER
    args.saturation = QUICK_SATURATION if args.quick else SATURATION
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by core-serve's workers
    with tempfile.TemporaryDirectory(prefix="one-user-") as folder:
        servers, texts = run_servers(args, Path(folder))
    result = {
        "benchmark": "one_user",
        "machine": machine_info(),
        "client": f"vllm bench serve (vLLM {args.peer_version})",
        "threads": args.threads,
        "dtype": args.dtype,
        "notes": (
            "llama-server: not found, left out. "
            if args.llama_server is None
            else f"llama-server: {args.llama_server}, one slot, the GGUF file as stored. "
        )
        + ("vllm serve: left out." if args.skip_vllm else "vllm serve: the HF folder."),
        "workloads": {
            "one user": args.one_user.describe(),
            "saturation": args.saturation.describe(),
        },  # fmt: skip
        "rounds": args.rounds,
        "servers": servers,
        "targets": targets(servers),
        "agreement": agreement(texts[CORE_GGUF], texts[LLAMA_SERVER])
        if LLAMA_SERVER in texts
        else None,
    }
    write_results(result, render_markdown(result), args.output_dir,
                  result_name("one_user", args.quick))  # fmt: skip
    print(render_markdown(result))
    failed = sum(w["summary"]["failed"] or 0 for s in servers.values() for w in s.values())
    print(f"failed requests: {failed} (must be 0)")


if __name__ == "__main__":
    main()
