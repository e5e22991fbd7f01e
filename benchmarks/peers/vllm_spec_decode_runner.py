"""vLLM's `AsyncLLM` in closed-loop runs, with or without a speculative config, as a benchmark
peer speaking the JSON-lines protocol of `benchmarks/harness/peer_process.py`. It runs under the peer's
own Python and imports only the standard library and vLLM; the project never imports it.

    <vllm venv>/bin/python benchmarks/peers/vllm_spec_decode_runner.py REQUEST.json

REQUEST.json: {"model": HF folder, "dtype": name, "max_model_len": n, "seed": n,
"speculative_config": vLLM's dict or null, "warm_up": WORKLOAD, "workloads": {name: WORKLOAD}},
WORKLOAD = {"prompt_token_ids": [[...]], "max_tokens": n, "ignore_eos": bool}.
Commands: {"run": name, "num_prompts": n, "concurrency": c}: the first n prompts, c in flight
(a request starts when an earlier one finishes), greedy, on an empty prefix cache. Answer:
{"type": "result", "workload": name, "elapsed_s": s, "requests": [{"start_s", "first_token_s",
"end_s", "output_token_ids"}, ...] in prompt order, "spec_decode": {"num_drafts",
"num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"}} (the deltas of
vLLM's spec_decode counters over the run, all zero without speculation).
"""

import asyncio
import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"


def main() -> int:
    # Run as a script, this folder (benchmarks/peers/, with a vllm.py of ours) heads sys.path;
    # nothing of the project may shadow vLLM from there.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    # The protocol owns the real stdout; everything else written to fd 1 goes to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        with open(sys.argv[1]) as file:
            request = json.load(file)
        asyncio.run(serve(request, send))
    except Exception as exc:
        traceback.print_exc()
        send({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


async def serve(request: dict, send) -> None:
    start = time.perf_counter()
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=request["model"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        seed=request["seed"],
        speculative_config=request["speculative_config"],
        disable_log_stats=False,  # the spec_decode counters need the stat loggers
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        warm_up = request["warm_up"]
        await run_closed_loop(llm, warm_up, len(warm_up["prompt_token_ids"]), 1)
        send({"type": "ready", "version": vllm.__version__,
              "startup_s": time.perf_counter() - start})  # fmt: skip
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if not line.strip():
                continue
            command = json.loads(line)
            name = command["run"]
            await llm.reset_prefix_cache()
            before = spec_counters()
            elapsed_s, requests = await run_closed_loop(
                llm, request["workloads"][name], command["num_prompts"], command["concurrency"]
            )
            after = spec_counters()
            send({"type": "result", "workload": name, "elapsed_s": elapsed_s,
                  "requests": requests, "spec_decode": counter_deltas(before, after)})  # fmt: skip
    finally:
        llm.shutdown()


async def run_closed_loop(llm, workload: dict, num_prompts: int, concurrency: int):
    """(seconds, request records in prompt order): prompts in order, `concurrency` in flight."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=workload["ignore_eos"]
    )
    slots = asyncio.Semaphore(concurrency)
    run_id = time.monotonic_ns()

    async def one(index: int) -> dict:
        async with slots:
            prompt = {"prompt_token_ids": workload["prompt_token_ids"][index]}
            start_s = time.monotonic()
            first_token_s = None
            token_ids: list[int] = []
            async for output in llm.generate(prompt, params, f"{run_id}-{index}"):
                token_ids = list(output.outputs[0].token_ids)  # cumulative
                if token_ids and first_token_s is None:
                    first_token_s = time.monotonic()
            return {"start_s": start_s, "first_token_s": first_token_s,
                    "end_s": time.monotonic(), "output_token_ids": token_ids}  # fmt: skip

    start = time.monotonic()
    requests = await asyncio.gather(*(one(index) for index in range(num_prompts)))
    return time.monotonic() - start, list(requests)


def spec_counters() -> dict:
    """vLLM's spec_decode counters now, summed over engines (zero when it does not draft)."""
    from vllm.v1.metrics.reader import Counter, Vector, get_metrics_snapshot

    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    per_pos: list[int] = []
    for metric in get_metrics_snapshot():
        if isinstance(metric, Counter) and metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POS_COUNTER:
            per_pos += [0] * (len(metric.values) - len(per_pos))
            for pos, value in enumerate(metric.values):
                per_pos[pos] += value
    counts["num_accepted_tokens_per_pos"] = per_pos
    return counts


def counter_deltas(before: dict, after: dict) -> dict:
    deltas = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    earlier = before["num_accepted_tokens_per_pos"]
    deltas["num_accepted_tokens_per_pos"] = [
        count - (earlier[pos] if pos < len(earlier) else 0)
        for pos, count in enumerate(after["num_accepted_tokens_per_pos"])
    ]
    return deltas


if __name__ == "__main__":
    sys.exit(main())
