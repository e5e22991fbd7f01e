"""Online serving: a Poisson load generator against `core-serve`, streaming completions.

At each offered request rate (Poisson arrivals, seeded; "inf" sends everything at once) the
same number of requests with seeded synthetic lengths is streamed through /v1/completions
(ignore_eos, greedy). Reported per rate: request throughput, output tokens/s, time to first
token (TTFT), inter-token latency (ITL: the gaps between streamed chunks, one per engine step),
end-to-end latency, p50/p90/p99, and the error count (must be 0). The in-run baselines: the
achieved share of the offered rate, and each latency against the same latency at the lightest
load. A PNG plot of throughput and latency against load is written next to the results.

By default the script starts its own `core-serve` (flags after --server-args); --url measures a
server that is already running. With `--peer vllm` the same requests then go, at the same rates,
to `vllm serve` on the same weights (an HF folder, `--hf-model`), started from vLLM's own Python
(`--peer-python`, see `benchmarks/peers/vllm.py`) once `core-serve` has stopped, so only one server
is ever loaded; both get the same dtype and threads, and the report adds engine / vLLM ratios.

With `--data-parallel-size N` it compares engine servers instead, on a workload of repeated
system prompts: N engine cores with one worker thread each against one core with one thread,
and against one core with N threads (see `benchmarks/serving/data_parallel.py`).

    python -m benchmarks.serving.bench [--quick] [--rates 0.25 0.5 1 inf] [--url http://host:8000]
    python -m benchmarks.serving.bench --peer vllm [--peer-python /path/to/venv/bin/python]
    python -m benchmarks.serving.bench --client vllm [--quick]     # vLLM's own client, both servers
    python -m benchmarks.serving.bench --data-parallel-size 2 [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    RESULTS_DIR,
    StreamedCompletion,
    core_serve,
    default_hf_folder,
    default_num_threads,
    engine_default_dtype,
    machine_info,
    make_text,
    markdown_table,
    mean,
    percentiles,
    result_name,
    stream_completion,
    write_results,
)
from benchmarks.harness.results_page import plot_serving

MAX_CONNECTIONS = 2048
REQUEST_TIMEOUT_S = 1800.0


@dataclass(slots=True, frozen=True)
class LengthDistribution:
    """Prompt words and output tokens, each uniform in its closed range."""

    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]

    def sample(self, rng: random.Random) -> tuple[str, int]:
        return make_text(rng, rng.randint(*self.prompt_words)), rng.randint(*self.output_tokens)


FULL_LENGTHS = LengthDistribution((10, 200), (16, 96))
QUICK_LENGTHS = LengthDistribution((5, 30), (4, 12))


def arrival_offsets_s(rng: random.Random, rate: float, num_requests: int) -> list[float]:
    """Poisson arrivals: exponential gaps with mean 1/rate; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def run_rate(
    url: str, model: str | None, rate: float, num_requests: int, lengths, seed: int
) -> dict:
    """Sends `num_requests` at `rate` and summarizes what came back."""
    rng = random.Random(f"{seed}-{rate}")  # fresh prompts per rate: no prefix cache carry-over
    requests = [lengths.sample(rng) for _ in range(num_requests)]
    offsets = arrival_offsets_s(rng, rate, num_requests)
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.monotonic()

        async def send(offset_s: float, prompt: str, max_tokens: int) -> StreamedCompletion:
            await asyncio.sleep(max(0.0, start + offset_s - time.monotonic()))
            payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}  # fmt: skip
            if model is not None:
                payload["model"] = model
            return await stream_completion(client, url, payload)

        results = await asyncio.gather(
            *(send(o, p, n) for o, (p, n) in zip(offsets, requests, strict=True))
        )
        elapsed_s = time.monotonic() - start
    return summarize(rate, results, elapsed_s, [n for _, n in requests])


def summarize(
    rate: float, results: list[StreamedCompletion], elapsed_s: float, max_tokens: list[int]
) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    num_short = sum(r.num_output_tokens != n for r, n in zip(results, max_tokens, strict=True))
    itl_s = [gap for r in ok for gap in r.inter_chunk_s]
    to_ms = lambda values: {k: v * 1e3 for k, v in percentiles(values).items()}  # noqa: E731
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "offered_rate": "inf" if math.isinf(rate) else rate,
        "num_requests": len(results),
        "num_errors": len(errors),
        "errors": errors[:5],
        "num_wrong_length": num_short,
        "duration_s": elapsed_s,
        "request_throughput": len(ok) / elapsed_s,
        "output_tokens_per_s": num_output_tokens / elapsed_s,
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in ok),
        "num_output_tokens": num_output_tokens,
        "ttft_ms": to_ms([r.ttft_s for r in ok]),
        "ttft_mean_ms": mean([r.ttft_s for r in ok]) * 1e3,
        "itl_ms": to_ms(itl_s),
        "itl_mean_ms": mean(itl_s) * 1e3,
        "latency_ms": to_ms([r.latency_s for r in ok]),
    }


async def warm_up(url: str, model: str | None) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        payload = {"prompt": "Hello there.", "max_tokens": 4, "ignore_eos": True}
        if model is not None:
            payload["model"] = model
        result = await stream_completion(client, url, payload)
    if result.error is not None:
        raise RuntimeError(f"the warm-up request failed: {result.error}")


def add_baseline_ratios(rows: list[dict]) -> None:
    """Achieved share of the offered rate; latencies relative to the lightest load's."""
    lightest = rows[0]
    for row in rows:
        rate = row["offered_rate"]
        row["achieved_vs_offered"] = None if rate == "inf" else row["request_throughput"] / rate
        row["ttft_p50_vs_lightest"] = row["ttft_ms"]["p50"] / lightest["ttft_ms"]["p50"]
        row["itl_p50_vs_lightest"] = row["itl_ms"]["p50"] / lightest["itl_ms"]["p50"]


async def run_all(
    url: str, model: str | None, rates: list[float], num_requests: int, lengths, seed: int
) -> list[dict]:
    await warm_up(url, model)
    rows = []
    for rate in rates:
        row = await run_rate(url, model, rate, num_requests, lengths, seed)
        rows.append(row)
        print(
            f"rate {row['offered_rate']}: {row['request_throughput']:.2f} req/s, "
            f"{row['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
            f"{row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.0f} ms, "
            f"errors {row['num_errors']}"
        )
    add_baseline_ratios(rows)
    return rows


def peer_ratios(rows: list[dict], peer_rows: list[dict]) -> list[dict]:
    """Engine / peer at each rate: throughputs (above 1: the engine serves more) and p50
    latencies (below 1: the engine answers sooner)."""
    ratios = []
    for ours, theirs in zip(rows, peer_rows, strict=True):
        if ours["offered_rate"] != theirs["offered_rate"]:
            raise ValueError(
                f"rates differ: {ours['offered_rate']} (engine) vs {theirs['offered_rate']} (peer)"
            )
        ratios.append(
            {
                "offered_rate": ours["offered_rate"],
                "request_throughput": _ratio(
                    ours["request_throughput"], theirs["request_throughput"]
                ),
                "output_tokens_per_s": _ratio(
                    ours["output_tokens_per_s"], theirs["output_tokens_per_s"]
                ),
                "ttft_p50": _ratio(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
                "itl_p50": _ratio(ours["itl_ms"]["p50"], theirs["itl_ms"]["p50"]),
                "latency_p50": _ratio(ours["latency_ms"]["p50"], theirs["latency_ms"]["p50"]),
            }
        )
    return ratios


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else math.nan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--server-args", default="--device cpu",
                        help="core-serve flags for the server this script starts")  # fmt: skip
    parser.add_argument("--served-model-name", default=None, help="the model field to send")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="offered requests/s, 'inf' for all at once")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=None, help="per rate")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="both servers' dtype (default: the engine's default)")  # fmt: skip
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of each server started here (default: one per usable core, the "
        "engine's default)",
    )
    parser.add_argument("--peer", default=None, choices=("vllm",),
                        help="also measure this server, after core-serve")  # fmt: skip
    parser.add_argument(
        "--client", default="ours", choices=("ours", "vllm"),
        help="vllm: vLLM's own `vllm bench serve` (from --peer-python) against core-serve and "
        "then vllm serve, on its random-token workloads (benchmarks/serving/vllm_client.py)",
    )  # fmt: skip
    parser.add_argument(
        "--peer-python",
        default=None,
        help="the Python of vLLM's virtual environment (default: $VLLM_PYTHON or "
        "/work/vllm-venv/bin/python)",
    )
    parser.add_argument("--hf-model", type=Path, default=None,
                        help="the engine's weights as an HF folder, for the peer "
                        "(default: the default model's, converted)")  # fmt: skip
    parser.add_argument(
        "--data-parallel-size", type=int, default=None,
        help="compare N engine cores (one thread each) with one core, on repeated prefixes",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 32
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.data_parallel_size is not None and (
        args.data_parallel_size < 2 or args.url is not None or args.peer is not None
    ):
        parser.error(
            "--data-parallel-size N needs N >= 2 and starts its own servers (no --url, --peer)"
        )
    if args.peer is not None and args.url is not None:
        parser.error("--peer starts both servers itself, one at a time; it cannot use --url")
    if "--dtype" in shlex.split(args.server_args):
        parser.error("pass the dtype with --dtype (it goes to every server), not --server-args")
    if args.client == "vllm" and (args.url is not None or args.data_parallel_size is not None):
        parser.error(
            "--client vllm starts core-serve and vllm serve itself (no --url, no --data-parallel-size)"
        )
    if args.client == "vllm":
        args.peer = "vllm"
    if args.peer == "vllm":
        from benchmarks.peers.vllm import default_peer_python, vllm_version

        args.peer_python = args.peer_python or default_peer_python()
        try:
            args.peer_version = vllm_version(args.peer_python)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def server_device(server_args: str) -> str:
    """The --device in core-serve flags ("auto", the engine's default, when there is none)."""
    flags = shlex.split(server_args)
    for index, flag in enumerate(flags):
        if flag == "--device" and index + 1 < len(flags):
            return flags[index + 1]
        if flag.startswith("--device="):
            return flag.split("=", 1)[1]
    return "auto"


def main() -> None:
    args = parse_args()
    rates = args.rates or ([2.0, math.inf] if args.quick else [0.25, 0.5, 1.0, 2.0, math.inf])
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    if args.data_parallel_size is not None:
        main_data_parallel(args, rates, lengths)
        return
    if args.client == "vllm":
        from benchmarks.serving import vllm_client as serving_vllm_client

        serving_vllm_client.main(args)
        return
    machine = machine_info()
    num_threads = args.threads or default_num_threads()
    dtype = args.dtype
    if args.url is None:
        dtype = dtype or engine_default_dtype(server_device(args.server_args))
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # inherited by the server's workers
    peer = None
    if args.peer == "vllm":  # fail now, not after the engine's run, if vLLM cannot run
        from benchmarks.peers.vllm import vllm_cpu_ids, vllm_env_settings

        hf_folder = args.hf_model or default_hf_folder(None)
        peer = {
            "name": "vllm",
            "version": args.peer_version,
            "python": args.peer_python,
            "server": f"vLLM's OpenAI server (what `vllm serve` runs) on {hf_folder}, {dtype}",
            "served_model_name": args.served_model_name or hf_folder.name,
            "env": vllm_env_settings(vllm_cpu_ids(num_threads)),
        }

    def run(url: str, model: str | None) -> list[dict]:
        return asyncio.run(run_all(url, model, rates, args.num_requests, lengths, args.seed))

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as folder:
        if args.url is not None:
            rows = run(args.url, args.served_model_name)
        else:
            engine_flags = [*shlex.split(args.server_args), "--dtype", dtype]
            with core_serve(engine_flags, Path(folder) / "server.log") as url:
                rows = run(url, args.served_model_name)
        if peer is not None:
            from benchmarks.peers.vllm import vllm_serve

            print(f"starting vllm serve ({args.peer_python}); it takes a minute or two")
            model = peer["served_model_name"]
            log_path = Path(folder) / "vllm-serve.log"
            with vllm_serve(
                args.peer_python, hf_folder, dtype, num_threads, model, log_path
            ) as url:
                peer["rows"] = run(url, model)
            peer["total_errors"] = sum(row["num_errors"] for row in peer["rows"])
    name = result_name("serving" if peer is None else "serving_vllm", args.quick)
    result = {
        "benchmark": "serving",
        "quick": args.quick,
        "machine": machine,
        "server": args.url or f"core-serve {args.server_args}",
        "dtype": dtype,
        "num_threads": None if args.url else num_threads,
        "omp_num_threads": None if args.url else num_threads,
        "num_requests_per_rate": args.num_requests,
        "prompt_words": list(lengths.prompt_words),
        "output_tokens": list(lengths.output_tokens),
        "seed": args.seed,
        "rows": rows,
        "total_errors": sum(row["num_errors"] for row in rows),
        "plot": f"{name}.png",
    }
    if peer is not None:
        result["peer"] = peer
        result["peer_ratios"] = peer_ratios(rows, peer["rows"])
    write_results(result, render_markdown(result), args.output_dir, name)
    plot_serving(result, args.output_dir / f"{name}.png")
    errors = result["total_errors"] + (peer["total_errors"] if peer else 0)
    print(f"errors: {errors} (must be 0)")


def main_data_parallel(args: argparse.Namespace, rates: list[float], lengths) -> None:
    """`--data-parallel-size N`: see `benchmarks.serving.data_parallel`."""
    from benchmarks.serving import data_parallel as dp

    dtype = args.dtype or engine_default_dtype(server_device(args.server_args))
    workload = dp.SharedPrefixWorkload.seeded(args.seed, (5, 40), lengths.output_tokens)
    run_rows = dp.run_rows_function(
        run_all, rates, args.num_requests, workload, args.seed, args.served_model_name
    )
    with tempfile.TemporaryDirectory(prefix="bench-serving-dp-") as folder:
        result = dp.compare(args, rates, dtype, run_rows, Path(folder))
    result["machine"] = machine_info()
    name = result_name(f"serving_dp{args.data_parallel_size}", args.quick)
    print(write_results(result, dp.render_markdown(result), args.output_dir, name))
    print(f"errors: {result['total_errors']} (must be 0)")


def render_markdown(result: dict) -> str:
    """The engine's table; with a peer, the peer's table and the engine / peer ratios."""
    conditions = ""
    if result.get("dtype") and result.get("num_threads"):
        conditions = f" ({result['dtype']}, {result['num_threads']} threads)"
    text = (
        f"### Serving: {result['server']}{conditions}, {result['num_requests_per_rate']} "
        f"streamed requests per rate, prompts of {result['prompt_words'][0]}-"
        f"{result['prompt_words'][1]} words, {result['output_tokens'][0]}-"
        f"{result['output_tokens'][1]} output tokens\n\n{_rows_table(result['rows'])}\n\n"
        f"Errors: {result['total_errors']} (must be 0). Plot: `{result['plot']}`."
    )
    peer = result.get("peer")
    if peer is None:
        return text
    label = f"vLLM {peer['version']}"
    text += (
        f"\n\n### Serving: {label}, the same requests at the same rates, after core-serve "
        f"stopped\n\n{_rows_table(peer['rows'])}\n\nServer: {peer['server']}. "
        f"Errors: {peer['total_errors']} (must be 0). Environment: "
        + ", ".join(f"`{key}={value}`" for key, value in peer["env"].items())
        + ".\n\n"
    )
    ratio_rows = [
        [
            ratio["offered_rate"],
            f"**{ratio['output_tokens_per_s']:.2f}x**",
            f"{ratio['request_throughput']:.2f}x",
            f"{ratio['ttft_p50']:.2f}x",
            f"{ratio['itl_p50']:.2f}x",
            f"{ratio['latency_p50']:.2f}x",
        ]
        for ratio in result["peer_ratios"]
    ]
    header = ["offered req/s", "output tok/s", "achieved req/s", "TTFT p50", "ITL p50",
              "latency p50"]  # fmt: skip
    text += (
        f"### Serving: engine / {label}\n\n{markdown_table(header, ratio_rows)}\n\n"
        "Above 1 the engine serves more; for latencies, below 1 it answers sooner."
    )
    return text


def _rows_table(rows: list[dict]) -> str:
    cells = []
    for row in rows:
        achieved = row["achieved_vs_offered"]
        cells.append(
            [
                row["offered_rate"],
                f"{row['request_throughput']:.2f}" + (f" ({achieved:.0%})" if achieved else ""),
                f"{row['output_tokens_per_s']:.1f}",
                "/".join(f"{row['ttft_ms'][p]:.0f}" for p in ("p50", "p90", "p99")),
                "/".join(f"{row['itl_ms'][p]:.0f}" for p in ("p50", "p90", "p99")),
                f"{row['ttft_p50_vs_lightest']:.1f}x / {row['itl_p50_vs_lightest']:.1f}x",
                row["num_errors"],
            ]
        )
    header = [
        "offered req/s",
        "achieved req/s",
        "output tok/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "TTFT / ITL p50 vs lightest load",
        "errors",
    ]
    return markdown_table(header, cells)


if __name__ == "__main__":
    main()
