"""Tiny pools, requests and a fake model for core tests: no model files, no torch."""

from __future__ import annotations

from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import LoRARequest, ModelRunnerOutput, SamplingParams, SchedulerOutput

BLOCK_SIZE = 4


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int | None = 16,
    block_size: int = BLOCK_SIZE,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    lora_request: LoRARequest | None = None,
    **sampling_kwargs,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)
    return Request(
        request_id,
        prompt_token_ids,
        params,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        block_size=block_size,
        lora_request=lora_request,
    )


def make_scheduler(kv_cache_config: KVCacheConfig | None = None, **overrides) -> Scheduler:
    config = dict(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=64,
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config), kv_cache_config)


def scheduled_req_ids(scheduler_output: SchedulerOutput) -> list[str]:
    new_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
    return new_ids + [r.req_id for r in scheduler_output.scheduled_cached_reqs]


def fake_model_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, next_token=lambda request: 1
) -> ModelRunnerOutput:
    """What a model would return: one token for each request whose scheduled tokens reach its
    end (`num_computed_tokens` was already advanced by `schedule()`), none mid-prefill."""
    req_ids = scheduled_req_ids(scheduler_output)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        done_prefill = request.num_computed_tokens >= request.num_tokens
        sampled.append([next_token(request)] if done_prefill else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_step(scheduler: Scheduler, next_token=lambda request: 1):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        scheduler_output, fake_model_output(scheduler, scheduler_output, next_token)
    )
    return scheduler_output, outputs


def check_spec_decode_integrity(scheduler: Scheduler) -> None:
    """Speculative decoding's between-steps invariants: no request holds drafts, none has more
    tokens computed than it has, and the accepted drafts never outnumber the drafted ones (nor
    differ from their count per position). Raises AssertionError."""
    for request in scheduler.requests.values():
        assert not request.spec_token_ids, f"{request} holds drafts between steps"
        assert request.num_computed_tokens <= request.num_tokens, f"{request} computed drafts"
    stats = scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
