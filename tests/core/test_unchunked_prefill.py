"""`enable_chunked_prefill=False` (vLLM's switch): every prompt is prefilled in one step, so the
step budget must hold max_model_len tokens; a prompt the rest of a step cannot hold waits."""

from __future__ import annotations

import pytest

from core_engine.core.sched.scheduler import SchedulerConfig
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.core_factories import make_request, make_scheduler, run_step


def test_a_prompt_that_does_not_fit_the_rest_of_a_step_waits_instead_of_being_split():
    prompts = {"a": list(range(40)), "b": list(range(100, 130)), "c": list(range(200, 210))}
    chunked, unchunked = make_scheduler(), make_scheduler(enable_chunked_prefill=False)
    for scheduler in (chunked, unchunked):  # budget = max_model_len = 64
        for request_id, prompt in prompts.items():
            scheduler.add_request(make_request(request_id, prompt, max_tokens=3))
    output, _ = run_step(chunked)
    assert output.num_scheduled_tokens == {"a": 40, "b": 24}
    output, _ = run_step(unchunked)
    # 24 tokens are left after a: b waits whole, and c (which would fit) waits behind it.
    assert output.num_scheduled_tokens == {"a": 40}
    output, _ = run_step(unchunked)
    assert output.num_scheduled_tokens == {"a": 1, "b": 30, "c": 10}
    assert [r.num_computed_tokens for r in output.scheduled_new_reqs] == [0, 0]


def test_a_resumed_request_is_prefilled_again_in_one_step():
    # 5 usable blocks of 4 tokens: two requests of 8 prompt tokens preempt each other as
    # they grow; a resumed request recomputes what the prefix cache lacks, never split.
    scheduler = make_scheduler(
        enable_chunked_prefill=False, max_model_len=16, max_num_batched_tokens=16, num_gpu_blocks=6
    )
    requests = {
        "a": make_request("a", list(range(8)), max_tokens=6),
        "b": make_request("b", list(range(100, 108)), max_tokens=6),
    }
    for request in requests.values():
        scheduler.add_request(request)
    finished = set()
    for _ in range(40):
        num_tokens = {request_id: r.num_tokens for request_id, r in requests.items()}
        output, outputs = run_step(scheduler)
        for resumed in output.scheduled_cached_reqs:
            if resumed.resumed_from_preemption:  # its prefix-cache hits, then all the rest
                num_scheduled = output.num_scheduled_tokens[resumed.req_id]
                assert resumed.num_computed_tokens + num_scheduled == num_tokens[resumed.req_id]
        finished |= {o.request_id for o in outputs.outputs if o.finished}
        if finished == {"a", "b"}:
            break
    assert finished == {"a", "b"}
    assert scheduler.num_preemptions >= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: SchedulerConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64
        ),
        lambda: EngineConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64
        ),
    ],
    ids=["SchedulerConfig", "EngineConfig"],
)
def test_a_budget_below_max_model_len_is_refused_naming_both(make):
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 is below max_model_len=64"):
        make()


def test_unchunked_prefill_refuses_a_long_prefill_threshold_and_accepts_a_budget_it_needs():
    with pytest.raises(ValueError, match="long_prefill_token_threshold=8 chunks long prompts"):
        EngineConfig(enable_chunked_prefill=False, long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=8 chunks long prompts"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=8)
    # Either limit left to the engine (the model's, the device's) is checked at start-up.
    assert not EngineConfig(enable_chunked_prefill=False, max_model_len=64).enable_chunked_prefill
    EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
