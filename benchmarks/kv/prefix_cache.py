"""Prefix caching: time to first token with a shared 1,000-token system prompt, caching on vs off.

Two `core-serve` processes, one after the other, identical but for `--enable-prefix-caching` /
`--no-enable-prefix-caching`, receive the same sequence of streamed requests, one at a time:
each prompt is the same 1,000-token system prompt followed by its own short question (token ids,
so the boundary is exact). TTFT is compared over the requests after the first (the first one
fills the cache). The hit rate is read from /metrics (`core:prefix_cache_hits_total /
core:prefix_cache_queries_total`, counted over the measured requests) and compared with the
ideal: every request after the first hits every full block of the system prompt.

Goals: hit rate within 1% of the ideal (relative: at least 0.99 x ideal); TTFT at least 5x
lower with caching on. `--quick` shortens the system prompt to 256 tokens.

    python -m benchmarks.kv.prefix_cache [--quick] [--server-args "--device cpu"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    RESULTS_DIR,
    core_serve,
    exact_length_prompt,
    machine_info,
    make_text,
    markdown_table,
    mean,
    percentiles,
    read_metrics,
    result_name,
    stream_completion,
    write_results,
)
from core_engine.frontend.async_engine_client import load_engine_tokenizer
from core_engine.proto.engine_config import EngineConfig

SYSTEM_PROMPT_TOKENS = 1000
BLOCK_SIZE = 16
MAX_TOKENS = 4
TARGET_TTFT_SPEEDUP = 5.0
MAX_HIT_RATE_SHORTFALL = 0.01  # relative to the ideal hit rate
QUICK_SYSTEM_PROMPT_TOKENS = 256
QUERIES_METRIC = "core:prefix_cache_queries_total"
HITS_METRIC = "core:prefix_cache_hits_total"


def build_prompts(
    encode, num_requests: int, seed: int, system_prompt_tokens: int
) -> list[list[int]]:
    """`num_requests` prompts: one shared system prompt plus a distinct question each.

    No two questions share their first BLOCK_SIZE tokens, so no block past the system prompt's
    full blocks can be shared between two prompts.
    """
    rng = random.Random(seed)
    system_prompt = exact_length_prompt(rng, encode, system_prompt_tokens)
    prompts, question_starts = [], set()
    while len(prompts) < num_requests:
        question = encode(" " + make_text(rng, rng.randint(8, 20)))
        if tuple(question[:BLOCK_SIZE]) in question_starts:
            continue
        question_starts.add(tuple(question[:BLOCK_SIZE]))
        prompts.append(system_prompt + question)
    return prompts


def ideal_hits(prompts: list[list[int]], system_prompt_tokens: int, block_size: int) -> int:
    """Hit tokens if every request after the first reuses every full system-prompt block
    (a hit never covers a prompt's last token)."""
    num_full_blocks = system_prompt_tokens // block_size
    return sum(
        min(num_full_blocks, (len(prompt) - 1) // block_size) * block_size for prompt in prompts[1:]
    )


async def run_sequence(url: str, prompts: list[list[int]]) -> list[float]:
    """Streams the prompts one at a time; returns each one's TTFT in seconds."""
    ttfts_s = []
    async with httpx.AsyncClient(timeout=1800.0) as client:
        for prompt in prompts:
            payload = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True}  # fmt: skip
            result = await stream_completion(client, url, payload)
            if result.error is not None:
                raise RuntimeError(f"a request failed: {result.error}")
            ttfts_s.append(result.ttft_s)
    return ttfts_s


def measure(
    server_args: list[str], caching: bool, warm_up_prompt: list[int], prompts: list[list[int]]
) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    with (
        tempfile.TemporaryDirectory(prefix="bench-prefix-") as folder,
        core_serve([*server_args, flag], Path(folder) / "server.log") as url,
    ):
        asyncio.run(run_sequence(url, [warm_up_prompt]))
        before = read_metrics(url)
        ttfts_s = asyncio.run(run_sequence(url, prompts))
        after = read_metrics(url)
    queries = after[QUERIES_METRIC] - before[QUERIES_METRIC]
    hits = after[HITS_METRIC] - before[HITS_METRIC]
    warm_ms = [t * 1e3 for t in ttfts_s[1:]]
    row = {
        "prefix_caching": caching,
        "first_request_ttft_ms": ttfts_s[0] * 1e3,
        "ttft_ms": percentiles(warm_ms),
        "ttft_mean_ms": mean(warm_ms),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
    }
    print(
        f"prefix caching {'on' if caching else 'off'}: TTFT p50 {row['ttft_ms']['p50']:.0f} ms "
        f"(first request {row['first_request_ttft_ms']:.0f} ms), hit rate {row['hit_rate']:.4f}"
    )
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument(
        "--server-args",
        default="--device cpu",
        help="core-serve flags for both servers (not the caching flag)",
    )
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=None,
        help=f"default {SYSTEM_PROMPT_TOKENS} ({QUICK_SYSTEM_PROMPT_TOKENS} quick)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS for the servers (0: leave unset)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.num_requests is None:
        args.num_requests = 4 if args.quick else 24
    if args.system_prompt_tokens is None:
        args.system_prompt_tokens = (
            QUICK_SYSTEM_PROMPT_TOKENS if args.quick else SYSTEM_PROMPT_TOKENS
        )
    return args


def main() -> None:
    args = parse_args()
    server_args = shlex.split(args.server_args)
    if "--block-size" in server_args:
        raise SystemExit("--block-size is fixed at 16 here (the ideal hit rate depends on it)")
    model = _flag_value(server_args, "--model")
    tokenizer = load_engine_tokenizer(EngineConfig(model=model))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = build_prompts(encode, args.num_requests, args.seed, args.system_prompt_tokens)
    warm_up_prompt = encode(make_text(random.Random(f"{args.seed}-warm-up"), 30))
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers' workers
    machine = machine_info()
    off = measure(server_args, False, warm_up_prompt, prompts)
    on = measure(server_args, True, warm_up_prompt, prompts)
    num_queried = sum(len(prompt) for prompt in prompts)
    ideal_hit_rate = ideal_hits(prompts, args.system_prompt_tokens, BLOCK_SIZE) / num_queried
    speedup = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
    result = {
        "benchmark": "prefix_cache",
        "quick": args.quick,
        "machine": machine,
        "server": f"core-serve {args.server_args}",
        "omp_num_threads": args.threads or None,
        "num_requests": args.num_requests,
        "system_prompt_tokens": args.system_prompt_tokens,
        "prompt_tokens": [len(prompt) for prompt in prompts],
        "max_tokens": MAX_TOKENS,
        "rows": [off, on],
        "ideal_hit_rate": ideal_hit_rate,
        "hit_rate_vs_ideal": on["hit_rate"] / ideal_hit_rate,
        "ttft_p50_speedup": speedup,
        "target_ttft_speedup": TARGET_TTFT_SPEEDUP,
        "meets_hit_rate_target": on["hit_rate"] >= (1 - MAX_HIT_RATE_SHORTFALL) * ideal_hit_rate,
        "meets_ttft_target": speedup >= TARGET_TTFT_SPEEDUP,
    }
    name = result_name("prefix_cache", args.quick)
    write_results(result, render_markdown(result), args.output_dir, name)
    print(
        f"TTFT p50 off / on: {speedup:.1f}x (target >= {TARGET_TTFT_SPEEDUP:.0f}x); hit rate "
        f"{on['hit_rate']:.4f} vs ideal {ideal_hit_rate:.4f}"
    )


def _flag_value(argv: list[str], flag: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def render_markdown(result: dict) -> str:
    rows = [
        [
            "on" if row["prefix_caching"] else "off",
            f"{row['first_request_ttft_ms']:.0f}",
            "/".join(f"{row['ttft_ms'][p]:.0f}" for p in ("p50", "p90", "p99")),
            f"{row['hit_rate']:.4f}",
        ]
        for row in result["rows"]
    ]
    table = markdown_table(
        [
            "prefix caching",
            "first request TTFT ms",
            "TTFT p50/p90/p99 ms (later requests)",
            "hit rate (/metrics)",
        ],  # fmt: skip
        rows,
    )
    return (
        f"### Prefix caching: {result['num_requests']} sequential requests sharing a "
        f"{result['system_prompt_tokens']}-token system prompt ({result['server']})\n\n"
        f"{table}\n\n"
        f"TTFT p50 off / on: **{result['ttft_p50_speedup']:.1f}x** (target >= "
        f"{result['target_ttft_speedup']:.0f}x, {_verdict(result['meets_ttft_target'])}); "
        f"hit rate {result['rows'][1]['hit_rate']:.4f} vs ideal "
        f"{result['ideal_hit_rate']:.4f} (target: at least 0.99 x ideal, "
        f"{_verdict(result['meets_hit_rate_target'])})."
    )


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


if __name__ == "__main__":
    main()
