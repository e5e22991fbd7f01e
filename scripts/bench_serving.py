"""Online serving: a Poisson load generator against `core-serve`, streaming completions.

At each offered request rate (Poisson arrivals, seeded; "inf" sends everything at once) the
same number of requests with seeded synthetic lengths is streamed through /v1/completions
(ignore_eos, greedy). Reported per rate: request throughput, output tokens/s, time to first
token (TTFT), inter-token latency (ITL: the gaps between streamed chunks, one per engine step),
end-to-end latency, p50/p90/p99, and the error count (must be 0). The in-run baselines: the
achieved share of the offered rate, and each latency against the same latency at the lightest
load. A PNG plot of throughput and latency against load is written next to the results.

By default the script starts its own `core-serve` (flags after --server-args); --url measures a
server that is already running.

    python -m scripts.bench_serving [--quick] [--rates 0.25 0.5 1 inf] [--url http://host:8000]
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

from scripts.bench_common import (
    RESULTS_DIR,
    StreamedCompletion,
    core_serve,
    machine_info,
    make_text,
    markdown_table,
    mean,
    percentiles,
    result_name,
    stream_completion,
    write_results,
)
from scripts.plot_results import plot_serving

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


async def run_all(url: str, args: argparse.Namespace, rates: list[float], lengths) -> list[dict]:
    await warm_up(url, args.served_model_name)
    rows = []
    for rate in rates:
        row = await run_rate(
            url, args.served_model_name, rate, args.num_requests, lengths, args.seed
        )
        rows.append(row)
        print(
            f"rate {row['offered_rate']}: {row['request_throughput']:.2f} req/s, "
            f"{row['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
            f"{row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.0f} ms, "
            f"errors {row['num_errors']}"
        )
    add_baseline_ratios(rows)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--server-args", default="--device cpu",
                        help="core-serve flags for the server this script starts")  # fmt: skip
    parser.add_argument("--served-model-name", default=None, help="the model field to send")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="offered requests/s, 'inf' for all at once")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=None, help="per rate")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the server started here (0: leave unset)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 32
    return args


def main() -> None:
    args = parse_args()
    rates = args.rates or ([2.0, math.inf] if args.quick else [0.25, 0.5, 1.0, 2.0, math.inf])
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    machine = machine_info()
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's workers
    if args.url is not None:
        rows = asyncio.run(run_all(args.url, args, rates, lengths))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as folder:
            log_path = Path(folder) / "server.log"
            with core_serve(shlex.split(args.server_args), log_path) as url:
                rows = asyncio.run(run_all(url, args, rates, lengths))
    name = result_name("serving", args.quick)
    result = {
        "benchmark": "serving",
        "quick": args.quick,
        "machine": machine,
        "server": args.url or f"core-serve {args.server_args}",
        "omp_num_threads": args.threads or None,
        "num_requests_per_rate": args.num_requests,
        "prompt_words": list(lengths.prompt_words),
        "output_tokens": list(lengths.output_tokens),
        "seed": args.seed,
        "rows": rows,
        "total_errors": sum(row["num_errors"] for row in rows),
        "plot": f"{name}.png",
    }
    write_results(result, render_markdown(result), args.output_dir, name)
    plot_serving(result, args.output_dir / f"{name}.png")
    print(f"errors: {result['total_errors']} (must be 0)")


def render_markdown(result: dict) -> str:
    rows = []
    for row in result["rows"]:
        achieved = row["achieved_vs_offered"]
        rows.append(
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
    table = markdown_table(
        [
            "offered req/s",
            "achieved req/s",
            "output tok/s",
            "TTFT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms",
            "TTFT / ITL p50 vs lightest load",
            "errors",
        ],
        rows,
    )
    return (
        f"### Serving: {result['server']}, {result['num_requests_per_rate']} streamed requests "
        f"per rate, prompts of {result['prompt_words'][0]}-{result['prompt_words'][1]} words, "
        f"{result['output_tokens'][0]}-{result['output_tokens'][1]} output tokens\n\n{table}\n\n"
        f"Errors: {result['total_errors']} (must be 0). Plot: `{result['plot']}`."
    )


if __name__ == "__main__":
    main()
