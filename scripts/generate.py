"""Generate text in one process: the core Scheduler drives a Worker directly, no IPC.

    python scripts/generate.py [--model PATH] [--device cpu|cuda] [--max-tokens N]
        [--temperature T] [--seed S] [--ignore-eos] [--max-num-batched-tokens N]
        [--num-gpu-blocks-override N] [--no-enable-prefix-caching] PROMPT...

All prompts run as one continuously batched workload; one JSON object per prompt is printed,
in order: {"prompt", "text", "token_ids" (generated only), "finish_reason"}. The same loop is
importable: `generate(prompts, ...)`, `generate_token_ids(prompt_token_ids, ...)`, and
`run_requests(scheduler, executor, requests)` for any object with `execute_model`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model_files import resolve_model_path
from core.request import Request
from core.scheduler import Scheduler, SchedulerConfig
from frontend.tokenizer import Tokenizer, load_tokenizer
from proto import ModelRunnerOutput, SamplingParams, SchedulerOutput, TokenLogprobs
from proto.engine_config import EngineConfig
from worker.worker import Worker


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class GenerationResult:
    """One request's generated tokens (prompt excluded) and why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str | None = None


@dataclass(slots=True)
class GenerationStats:
    """Counters of one workload; prefix cache counters are in tokens."""

    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_gpu_blocks: int = 0
    elapsed_s: float = 0.0


@dataclass(slots=True)
class GenerationOutput:
    results: list[GenerationResult]
    stats: GenerationStats


def run_requests(
    scheduler: Scheduler, executor: Executor, requests: Sequence[Request]
) -> GenerationOutput:
    """Adds `requests`, steps schedule -> execute_model -> update_from_output until all finish.

    Returns results in the order of `requests`. Tokens of a request are collected from the
    scheduler's outputs, so they are exactly what a client would receive.
    """
    results = {
        r.request_id: GenerationResult(r.request_id, list(r.prompt_token_ids)) for r in requests
    }
    for request in requests:
        scheduler.add_request(request)
    stats = GenerationStats()
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        model_runner_output = executor.execute_model(scheduler_output)
        engine_outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
        for output in engine_outputs.outputs:
            result = results[output.request_id]
            result.token_ids.extend(output.new_token_ids)
            result.logprobs.extend(output.new_logprobs or [])
            if output.finish_reason is not None:
                result.finish_reason = str(output.finish_reason)
    _fill_stats(stats, scheduler, time.perf_counter() - start)
    return GenerationOutput([results[r.request_id] for r in requests], stats)


def _fill_stats(stats: GenerationStats, scheduler: Scheduler, elapsed_s: float) -> None:
    scheduler_stats = scheduler.get_stats()
    stats.num_steps = scheduler_stats.num_steps
    stats.num_preemptions = scheduler_stats.num_preemptions
    stats.prefix_cache_queries = scheduler_stats.prefix_cache_queries
    stats.prefix_cache_hits = scheduler_stats.prefix_cache_hits
    stats.num_prompt_tokens = scheduler_stats.num_prompt_tokens
    stats.num_generation_tokens = scheduler_stats.num_generation_tokens
    stats.num_gpu_blocks = scheduler.config.num_gpu_blocks
    stats.elapsed_s = elapsed_s


def make_requests(
    prompt_token_ids: Sequence[Sequence[int]],
    sampling_params: SamplingParams,
    eos_token_ids: Sequence[int],
    block_size: int,
) -> list[Request]:
    """One request per prompt, ids "0", "1", ...; every eos id stops unless ignore_eos."""
    eos_token_id = eos_token_ids[0] if eos_token_ids else None
    if len(eos_token_ids) > 1 and not sampling_params.ignore_eos:
        extra_stops = [t for t in eos_token_ids[1:] if t not in sampling_params.stop_token_ids]
        stop_token_ids = [*sampling_params.stop_token_ids, *extra_stops]
        sampling_params = msgspec.structs.replace(sampling_params, stop_token_ids=stop_token_ids)
    return [
        Request(
            str(i), list(ids), sampling_params, eos_token_id=eos_token_id, block_size=block_size
        )
        for i, ids in enumerate(prompt_token_ids)
    ]


def generate_token_ids(
    prompt_token_ids: Sequence[Sequence[int]],
    config: EngineConfig | None = None,
    *,
    sampling_params: SamplingParams | None = None,
    worker: Worker | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> GenerationOutput:
    """Runs token-id prompts as one workload under `config` (model, device, token budget, KV
    pool, prefix caching). Pass a loaded `worker` to reuse its model: its KV cache is
    re-initialised, so earlier state is dropped, and config's limits (`max_num_seqs`,
    `max_num_batched_tokens`, `max_model_len`) must not exceed the worker's.
    `eos_token_ids` default to the model's; any of them stops a request unless `ignore_eos`.
    """
    config = config or EngineConfig()
    sampling_params = sampling_params or SamplingParams(temperature=0.0, max_tokens=32)
    worker = worker or load_worker(config)
    scheduler_config = make_scheduler_config(config, worker)
    worker.initialize_cache(scheduler_config.num_gpu_blocks)
    if eos_token_ids is None:
        eos_token_ids = worker.eos_token_ids
    requests = make_requests(prompt_token_ids, sampling_params, eos_token_ids, worker.block_size)
    return run_requests(Scheduler(scheduler_config), worker, requests)


def load_worker(config: EngineConfig) -> Worker:
    """A single-device Worker with the model of `config` loaded."""
    worker = Worker(
        config.model,
        device=config.device,
        dtype=config.dtype,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        enforce_eager=config.enforce_eager,
    )
    worker.load_model()
    return worker


def make_scheduler_config(config: EngineConfig, worker: Worker) -> SchedulerConfig:
    """The scheduler's limits from `config`, checked against what `worker` was built for; the
    KV pool is `num_gpu_blocks_override` or what the worker measures."""
    max_model_len = config.max_model_len or worker.max_model_len
    max_num_batched_tokens = config.max_num_batched_tokens or worker.max_num_batched_tokens
    for name, value, limit in (
        ("max_num_seqs", config.max_num_seqs, worker.max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens, worker.max_num_batched_tokens),
        ("max_model_len", max_model_len, worker.max_model_len),
    ):
        if value > limit:
            raise ValueError(f"{name}={value} exceeds the worker's {name}={limit}")
    if config.block_size != worker.block_size:
        raise ValueError(
            f"block_size={config.block_size} differs from the worker's {worker.block_size}"
        )
    num_gpu_blocks = config.num_gpu_blocks_override or worker.determine_num_available_blocks()
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_gpu_blocks=num_gpu_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.policy,
    )


def generate(
    prompts: Sequence[str],
    config: EngineConfig | None = None,
    *,
    sampling_params: SamplingParams | None = None,
    worker: Worker | None = None,
    tokenizer: Tokenizer | None = None,
) -> GenerationOutput:
    """Text prompts in, text out: tokenizes with the model's tokenizer (no chat template),
    runs `generate_token_ids` (stopping on the tokenizer's eos ids), decodes into `text`."""
    config = config or EngineConfig()
    tokenizer = tokenizer or load_tokenizer(resolve_model_path(config.model))
    output = generate_token_ids(
        [tokenizer.encode(prompt) for prompt in prompts],
        config,
        sampling_params=sampling_params,
        worker=worker,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    for result in output.results:
        result.text = tokenizer.decode(result.token_ids)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    sampling_params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    output = generate(args.prompts, config, sampling_params=sampling_params)
    for prompt, result in zip(args.prompts, output.results, strict=True):
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    stats = output.stats
    print(
        f"{stats.num_steps} steps, {stats.num_generation_tokens} tokens in {stats.elapsed_s:.2f} s, "
        f"{stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hit tokens",
        file=sys.stderr,
    )
    return 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
