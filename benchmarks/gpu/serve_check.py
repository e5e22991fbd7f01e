"""The engine served over HTTP: `core-serve` on random weights of a real model's shape, driven by
the project's own streaming client.

    python -m benchmarks.gpu.serve_check --model llama-3.2-1b [--device cuda] [--out FILE.json]

Starts `core-serve` with its defaults (on a GPU: bf16, decode steps as CUDA graphs) on the
random model, warms it up, then runs closed-loop loads of streamed /v1/completions, each prompt
128 random token ids and 128 greedy tokens (ignore_eos): one user (8 requests, one at a time),
64 at once (64 requests) and saturation (256 requests at once). Per load: output tok/s, TTFT,
inter-token latency and end-to-end latency percentiles, and the failed requests (any fails the
check). The `tiny` shape on the CPU runs the same loads, smaller (the GPU kit's dry run).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.gpu.engine_check import (
    MODEL_SHAPES,
    check_parser,
    cuda_missing,
    random_prompts,
    write_random_model,
)
from benchmarks.harness.common import StreamedCompletion, core_serve, stream_completion
from benchmarks.serving.bench import summarize

# (label, requests, concurrency) of each load; `tiny` runs them with DRY_RUN_SCALE of the size.
LOADS = (("one user", 8, 1), ("64 at once", 64, 64), ("saturation", 256, 256))
DRY_RUN_SCALE = 16
PROMPT_LEN = 128
MAX_TOKENS = 128
REQUEST_TIMEOUT_S = 600.0


async def closed_loop(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[list[StreamedCompletion], float]:
    """Streams every prompt, at most `concurrency` in flight, in order; results and wall time."""
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def send(prompt: list[int]) -> StreamedCompletion:
            payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}  # fmt: skip
            async with slots:
                return await stream_completion(client, url, payload)

        start = time.monotonic()
        results = await asyncio.gather(*(send(prompt) for prompt in prompts))
        return results, time.monotonic() - start


async def run_loads(url: str, vocab_size: int, scale: int, max_tokens: int) -> list[dict]:
    warm_up, _ = await closed_loop(url, random_prompts([16] * 4, vocab_size, seed=0), 8, 4)
    if any(result.error for result in warm_up):
        raise RuntimeError(f"the warm-up failed: {[r.error for r in warm_up if r.error]}")
    rows = []
    for index, (label, num_requests, concurrency) in enumerate(LOADS):
        num_requests, concurrency = max(1, num_requests // scale), max(1, concurrency // scale)
        prompts = random_prompts([PROMPT_LEN // scale] * num_requests, vocab_size, seed=1 + index)
        results, elapsed_s = await closed_loop(url, prompts, max_tokens, concurrency)
        row = summarize(float("inf"), results, elapsed_s, [max_tokens] * num_requests)
        row |= {"load": label, "concurrency": concurrency}
        print(
            f"{label}: {row['output_tokens_per_s']:.0f} output tok/s, TTFT p50 "
            f"{row['ttft_ms']['p50']:.1f} ms, ITL p50 {row['itl_ms']['p50']:.2f} ms, "
            f"errors {row['num_errors']}",
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = check_parser(__doc__, "llama-3.2-1b").parse_args(argv)
    if cuda_missing(args.device):
        return 2
    shape = MODEL_SHAPES[args.model]
    scale = DRY_RUN_SCALE if args.model == "tiny" else 1
    max_tokens = MAX_TOKENS // scale
    result: dict = {"model": args.model, "device": args.device, "prompt_len": PROMPT_LEN // scale,
                    "max_tokens": max_tokens}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"random-{args.model}-") as tmp:
        folder = write_random_model(Path(tmp) / "model", shape, torch.device(args.device))
        flags = ["--model", str(folder), "--device", args.device,
                 "--max-model-len", str(2 * (PROMPT_LEN + MAX_TOKENS))]  # fmt: skip
        with core_serve(flags, log_path=Path(tmp) / "core-serve.log") as url:
            result["loads"] = asyncio.run(run_loads(url, shape["vocab_size"], scale, max_tokens))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    failed = sum(row["num_errors"] + row["num_wrong_length"] for row in result["loads"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
