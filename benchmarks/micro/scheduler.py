"""Scheduler cost per step and per running request, on a simulated workload.

A fake model returns one token per request, so only the CPU scheduler is measured:
`schedule()` + `update_from_output()` microseconds per step and per running request at several
batch sizes, steps/s, and the prefix-cache hit rate. The figure that matters is the ratio of the
per-request cost at the largest batch to the smallest (flat = ratio near 1; target <= 1.5).

    python -m benchmarks.micro.scheduler [--quick] [--num-requests 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import ModelRunnerOutput, SamplingParams

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BLOCK_SIZE = 16
SHARED_PREFIX_LEN = 512


def build_requests(num_requests: int, seed: int, max_prompt_len: int) -> list[Request]:
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(1, 32000) for _ in range(SHARED_PREFIX_LEN)]
    requests = []
    for index in range(num_requests):
        prompt_len = rng.randint(200, max_prompt_len)
        if index % 2 == 0 and prompt_len > SHARED_PREFIX_LEN:
            tail = [rng.randrange(1, 32000) for _ in range(prompt_len - SHARED_PREFIX_LEN)]
            prompt = shared_prefix + tail
        else:
            prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=rng.randint(64, 256), ignore_eos=True)
        requests.append(Request(f"r{index}", prompt, params, block_size=BLOCK_SIZE))
    return requests


def run(num_running: int, requests: list[Request], max_prompt_len: int) -> dict:
    max_model_len = max_prompt_len + 256
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    config = SchedulerConfig(
        max_num_seqs=num_running,
        max_num_batched_tokens=max(8192, 32 * num_running),
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_running * blocks_per_request + 1,
    )
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    full_batch_step_us = []
    total_s = 0.0
    num_steps = 0
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        scheduler_output = scheduler.schedule()
        runner_output = fake_model_output(scheduler, scheduler_output)
        scheduler.update_from_output(scheduler_output, runner_output)
        elapsed = time.perf_counter() - start
        total_s += elapsed
        num_steps += 1
        if len(scheduler_output.num_scheduled_tokens) >= 0.95 * num_running:
            full_batch_step_us.append(elapsed * 1e6)
    if not full_batch_step_us:
        raise RuntimeError(f"the workload never reached {num_running} running requests")
    step_us = statistics.median(full_batch_step_us)
    stats = scheduler.get_stats()
    return {
        "num_running": num_running,
        "num_steps": num_steps,
        "num_full_batch_steps": len(full_batch_step_us),
        "steps_per_s": num_steps / total_s,
        "step_us_median": step_us,
        "us_per_running_request": step_us / num_running,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "preemptions": stats.num_preemptions,
    }


def fake_model_output(scheduler: Scheduler, scheduler_output) -> ModelRunnerOutput:
    """One token for each request whose prompt is done (the time it takes is counted, as a
    real engine core pays the same walk to route outputs)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [1] if requests[rid].num_computed_tokens >= requests[rid].num_tokens else []
        for rid in req_ids
    ]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, well under a minute")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    batch_sizes = (16, 64, 256) if args.quick else (64, 256, 1024)
    num_requests = 400 if args.quick else args.num_requests
    max_prompt_len = 600 if args.quick else 2000
    rows = []
    for num_running in batch_sizes:
        requests = build_requests(max(num_requests, 3 * num_running), args.seed, max_prompt_len)
        rows.append(run(num_running, requests, max_prompt_len))
        print(json.dumps(rows[-1]))
    ratio = rows[-1]["us_per_running_request"] / rows[0]["us_per_running_request"]
    result = {
        "benchmark": "scheduler",
        "quick": args.quick,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "rows": rows,
        "per_request_cost_ratio_largest_vs_smallest": ratio,
        "target_ratio": 1.5,
    }
    write_results(result, args.output_dir, "scheduler_quick" if args.quick else "scheduler")
    print(
        f"per-running-request cost, {batch_sizes[-1]} vs {batch_sizes[0]}: {ratio:.2f}x (target <= 1.5x)"
    )


def write_results(result: dict, output_dir: Path, name: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| running | steps | steps/s | step µs (median, batch >= 95% full) | µs / running request | prefix hit rate |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['num_running']} | {row['num_steps']} | {row['steps_per_s']:.0f} | "
            f"{row['step_us_median']:.0f} | {row['us_per_running_request']:.2f} | "
            f"{row['prefix_cache_hit_rate']:.3f} |"
        )
    lines.append("")
    lines.append(
        f"Per-request cost ratio (largest / smallest batch): "
        f"{result['per_request_cost_ratio_largest_vs_smallest']:.2f} (target <= 1.5)"
    )
    (output_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
