"""Scheduler: budgets, chunked prefill, prefix hits, preemption, policies, stops, aborts."""

from __future__ import annotations

import pytest

from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.request import RequestStatus
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import FinishReason, ModelRunnerOutput
from core_engine.proto.sampling_params import StructuredOutputs
from tests.helpers.core_factories import (
    BLOCK_SIZE,
    fake_model_output,
    make_request,
    make_scheduler,
    run_step,
    scheduled_req_ids,
)


def history_token(request) -> int:
    """A deterministic 'model': the next token is a function of the whole token history."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % 97 + 3


def run_to_completion(scheduler, next_token=history_token, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        _, outputs = run_step(scheduler, next_token)
        scheduler.kv_cache_manager.block_pool.check_integrity()
        for output in outputs.outputs:
            entry = finished.setdefault(output.request_id, {"tokens": [], "reason": None})
            entry["tokens"] += output.new_token_ids
            entry["reason"] = output.finish_reason
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(25)), max_tokens=2))
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 10}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
    output, outputs = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 10}
    assert output.scheduled_cached_reqs[0].num_computed_tokens == 10
    assert outputs.outputs == []  # still mid-prefill: nothing sampled
    output, outputs = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 5}
    assert outputs.outputs[0].new_token_ids == [1]


def test_running_requests_are_served_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(6)), max_tokens=5))
    run_step(scheduler)  # a prefilled with 6 tokens
    scheduler.add_request(make_request("b", list(range(20)), max_tokens=5))
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 7}
    assert scheduled_req_ids(output) == ["b", "a"]  # new requests listed first in the output


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=4))
    output, _ = run_step(scheduler)
    assert sorted(output.num_scheduled_tokens) == ["r0", "r1"]
    assert len(scheduler.waiting) == 1


def test_long_prefill_token_threshold_caps_a_prompt_per_step():
    scheduler = make_scheduler(long_prefill_token_threshold=6)
    scheduler.add_request(make_request("a", list(range(20))))
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 6}


def test_waiting_request_uses_prefix_hits():
    scheduler = make_scheduler()
    prompt = list(range(100, 117))  # 4 full blocks of 4 + 1
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", prompt[:16] + [5, 6], max_tokens=1))
    output, _ = run_step(scheduler)
    new_req = output.scheduled_new_reqs[0]
    assert new_req.num_computed_tokens == 16
    assert output.num_scheduled_tokens == {"b": 2}
    assert len(new_req.block_ids[0]) == 5
    stats = scheduler.get_stats()
    assert stats.prefix_cache_hits == 16


def prefix_counters(scheduler) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((requests, queries, hits), (preempted requests, queries, hits)) from get_stats."""
    stats = scheduler.get_stats()
    return (
        (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits),
        (
            stats.prefix_cache_preempted_requests,
            stats.prefix_cache_preempted_queries,
            stats.prefix_cache_preempted_hits,
        ),
    )


def test_a_request_waiting_several_steps_for_blocks_is_counted_once_when_admitted():
    scheduler = make_scheduler(num_gpu_blocks=6, max_model_len=20)
    prompt = list(range(100, 116))  # 4 of the 5 usable blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    run_step(scheduler)
    # b hits a's first 2 blocks but needs 1 more: none is free until a finishes 2 steps later
    scheduler.add_request(make_request("b", prompt[:8] + [7, 7, 7, 7], max_tokens=1))
    waited = [run_step(scheduler)[0].num_scheduled_tokens for _ in range(3)]
    assert waited == [{"a": 1}, {"a": 1}, {"b": 4}]
    assert prefix_counters(scheduler) == ((2, 16 + 12, 8), (0, 0, 0))


def test_a_preempted_request_s_lookup_on_resuming_goes_to_the_preempted_counters():
    scheduler = make_scheduler(num_gpu_blocks=5, max_model_len=16, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", [1] * 7, max_tokens=5))
    scheduler.add_request(make_request("b", [2] * 7, max_tokens=3))
    outputs = [run_step(scheduler)[0] for _ in range(6)]
    assert outputs[2].preempted_req_ids == ["b"]  # a needs a 3rd block
    # b waits until a finishes (looked up 3 times), then resumes from its 1 surviving block
    assert [o.num_scheduled_tokens for o in outputs[3:]] == [{"a": 1}, {"a": 1}, {"b": 5}]
    assert prefix_counters(scheduler) == ((2, 14, 0), (1, 7 + 2, 4))


def test_scheduler_output_is_a_diff():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    first, _ = run_step(scheduler, lambda r: 9)
    assert [r.req_id for r in first.scheduled_new_reqs] == ["a"]
    assert first.scheduled_new_reqs[0].block_ids == [[1]]
    second, _ = run_step(scheduler, lambda r: 9)
    assert second.scheduled_new_reqs == []
    cached = second.scheduled_cached_reqs[0]
    assert (cached.req_id, cached.num_computed_tokens, cached.new_token_ids) == ("a", 3, [9])
    assert cached.new_block_ids == [] and not cached.resumed_from_preemption
    third, _ = run_step(scheduler, lambda r: 9)
    assert third.scheduled_cached_reqs[0].new_block_ids == [[2]]  # 5th token needs block 2


def test_preemption_by_recompute_then_resume_with_unchanged_outputs():
    def workload(scheduler):
        for i in range(6):
            scheduler.add_request(
                make_request(f"r{i}", [i + 1] * (5 + 3 * i), max_tokens=12, ignore_eos=True)
            )
        return run_to_completion(scheduler)

    roomy = make_scheduler(num_gpu_blocks=100)
    expected = workload(roomy)
    assert roomy.num_preemptions == 0
    tight = make_scheduler(num_gpu_blocks=17, max_model_len=64)
    assert workload(tight) == expected
    assert tight.num_preemptions > 0
    assert tight.kv_cache_manager.block_pool.get_num_free_blocks() == 16


def test_preemption_picks_the_last_running_request_and_admits_nobody():
    scheduler = make_scheduler(num_gpu_blocks=5, max_model_len=16, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=8))
    scheduler.add_request(make_request("b", [9, 8, 7, 6, 5, 4, 3], max_tokens=8))
    run_step(scheduler)  # a: blocks 1,2; b: blocks 3,4 -> pool full
    scheduler.add_request(make_request("c", [1], max_tokens=8))
    output, _ = run_step(scheduler)  # a reaches 8 tokens, needs no block yet
    output, _ = run_step(scheduler)  # a needs a 3rd block: b is preempted
    assert output.preempted_req_ids == ["b"]
    assert list(output.num_scheduled_tokens) == ["a"]  # c not admitted in this step
    preempted = [r for r in scheduler.waiting]
    assert preempted[0].request_id == "b"
    assert preempted[0].status == RequestStatus.PREEMPTED
    assert preempted[0].num_computed_tokens == 0


def test_resumed_request_is_sent_with_its_whole_block_list():
    scheduler = make_scheduler(num_gpu_blocks=5, max_model_len=16, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", [1] * 7, max_tokens=3))
    scheduler.add_request(make_request("b", [2] * 7, max_tokens=3))
    run_step(scheduler)
    run_step(scheduler)
    run_step(scheduler)  # b preempted while a grows
    resumed = None
    for _ in range(10):
        output, _ = run_step(scheduler)
        resumed = next((r for r in output.scheduled_cached_reqs if r.resumed_from_preemption), None)
        if resumed:
            break
    assert resumed is not None and resumed.req_id == "b"
    # b's first full block survived in the prefix cache, so it resumes from 4 computed tokens
    assert resumed.num_computed_tokens == 4
    num_tokens = resumed.num_computed_tokens + output.num_scheduled_tokens["b"]
    assert num_tokens == 7 + 2  # the whole history (prompt + 2 generated) is recomputed
    assert len(resumed.new_block_ids[0]) == -(-num_tokens // 4)


def test_priority_policy_schedules_and_preempts_by_priority():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("low", [1, 2], priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("high", [3, 4], priority=0, arrival_time=2.0))
    output, _ = run_step(scheduler)
    assert list(output.num_scheduled_tokens) == ["high"]

    scheduler = make_scheduler(
        policy="priority", num_gpu_blocks=5, max_model_len=16, max_num_batched_tokens=32
    )
    scheduler.add_request(make_request("low", [1] * 7, priority=9, arrival_time=1.0))
    scheduler.add_request(make_request("high", [2] * 7, priority=1, arrival_time=2.0))
    run_step(scheduler)
    run_step(scheduler)
    output, _ = run_step(scheduler)
    assert output.preempted_req_ids == ["low"]


def test_stop_on_eos_unless_ignore_eos_and_not_before_min_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", [1, 2], eos_token_id=7, max_tokens=10))
    scheduler.add_request(
        make_request("ignore", [1, 2], eos_token_id=7, max_tokens=3, ignore_eos=True)
    )
    scheduler.add_request(make_request("min", [1, 2], eos_token_id=7, max_tokens=10, min_tokens=4))
    finished = run_to_completion(scheduler, lambda r: 7)
    assert finished["eos"] == {"tokens": [7], "reason": FinishReason.STOP}
    assert finished["ignore"] == {"tokens": [7, 7, 7], "reason": FinishReason.LENGTH}
    assert finished["min"] == {"tokens": [7, 7, 7, 7], "reason": FinishReason.STOP}


def test_a_last_allowed_token_that_ends_the_request_is_a_stop_not_a_length_cap():
    """eos and stop tokens are checked before the length limits, so the reason is stop."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", [1, 2], eos_token_id=7, max_tokens=1))
    scheduler.add_request(make_request("stop", [1, 2], stop_token_ids=[7], max_tokens=1))
    scheduler.add_request(make_request("min", [1, 2], eos_token_id=7, max_tokens=2, min_tokens=2))
    scheduler.add_request(make_request("other", [1, 2], eos_token_id=8, max_tokens=1))
    finished = run_to_completion(scheduler, lambda r: 7)
    assert finished["eos"] == {"tokens": [7], "reason": FinishReason.STOP}
    assert finished["stop"] == {"tokens": [7], "reason": FinishReason.STOP}
    assert finished["min"] == {"tokens": [7, 7], "reason": FinishReason.STOP}
    assert finished["other"] == {"tokens": [7], "reason": FinishReason.LENGTH}


def test_stop_token_ids_set_stop_reason():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1], stop_token_ids=[5], max_tokens=10))
    tokens = iter([3, 4, 5, 6])
    outputs = []
    while scheduler.has_unfinished_requests():
        _, step = run_step(scheduler, lambda r: next(tokens))
        outputs += step.outputs
    assert [o.new_token_ids[0] for o in outputs] == [3, 4, 5]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason == 5


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", [1] * 6, max_tokens=None))
    finished = run_to_completion(scheduler)
    assert len(finished["a"]["tokens"]) == 2
    assert finished["a"]["reason"] == FinishReason.LENGTH


def test_a_request_the_scheduler_cannot_hold_is_rejected_and_the_loop_goes_on():
    """The scheduler's own invariants: one request per id, the engine's block size (whether a
    request fits the model is checked where it is built: tests/proto/test_request_fit.py)."""
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("ok", [1] * 4, max_tokens=2))
    duplicate = make_request("ok", [1] * 4)
    with pytest.raises(ValueError, match="request id 'ok' is already in use"):
        scheduler.add_request(duplicate)
    assert duplicate.status == RequestStatus.FINISHED_IGNORED
    other_blocks = make_request("other", [1] * 4, block_size=BLOCK_SIZE * 2)
    with pytest.raises(ValueError, match=f"block_size {BLOCK_SIZE * 2} != engine block_size"):
        scheduler.add_request(other_blocks)
    assert list(scheduler.requests) == ["ok"]
    assert run_to_completion(scheduler)["ok"]["reason"] == FinishReason.LENGTH


def test_abort_frees_blocks_and_is_reported_to_workers():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("run", list(range(10)), max_tokens=50))
    scheduler.add_request(make_request("wait", list(range(10)), max_tokens=50))
    run_step(scheduler)
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
    output = scheduler.schedule()
    assert sorted(output.finished_req_ids) == ["run", "wait"]
    assert output.is_empty


def test_tokens_for_a_request_aborted_mid_step_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2], max_tokens=5))
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    result = scheduler.update_from_output(
        output, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[1]])
    )
    assert result.outputs == []
    assert scheduler.kv_cache_manager.usage == 0.0


def test_config_validates_itself():
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1, got 0"):
        SchedulerConfig(max_num_seqs=0)
    too_small = SchedulerConfig(max_model_len=4096, block_size=16, num_gpu_blocks=100)
    with pytest.raises(
        ValueError,
        match=r"num_gpu_blocks=100 cannot hold one request of max_model_len=4096 tokens \(256 "
        r"blocks of 16 plus the null block\)",
    ):
        Scheduler(too_small)  # checked once, by the scheduler, for every KV cache group layout


def test_stats_report_running_waiting_usage_and_preemptions():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    scheduler.add_request(make_request("b", [1, 2, 3], max_tokens=4))
    run_step(scheduler)
    stats = scheduler.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(1 / 63)
    assert stats.num_prompt_tokens == 6 and stats.num_generation_tokens == 1


# ---- a constrained request waits outside the batch while its grammar compiles ------------------

REGEX = StructuredOutputs(regex="[a-z]+")


def test_a_constrained_request_waits_for_its_grammar_without_blocks_then_runs():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("free", [1, 2, 3], max_tokens=8))
    scheduler.add_request(make_request("fsm", [4, 5, 6, 7, 8], structured_outputs=REGEX))
    assert scheduler.requests["fsm"].status == RequestStatus.WAITING_FOR_FSM
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"free": 3}
    assert output.grammars_to_prepare == {"fsm": REGEX}
    assert scheduler.kv_cache_manager.get_block_ids("fsm") == ([],)
    assert (scheduler.get_stats().num_waiting_reqs, scheduler.get_num_unfinished_requests()) == (
        1,
        2,
    )
    output, _ = run_step(scheduler)  # no report yet: still waiting, constraint not sent again
    assert (output.num_scheduled_tokens, output.grammars_to_prepare) == ({"free": 1}, {})
    assert scheduler.requests["fsm"].status == RequestStatus.WAITING_FOR_FSM
    output = scheduler.schedule()
    model_output = fake_model_output(scheduler, output)
    model_output.grammars_ready = ["fsm"]
    scheduler.update_from_output(output, model_output)
    assert scheduler.requests["fsm"].status == RequestStatus.WAITING
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"fsm": 5, "free": 1}
    assert scheduler.kv_cache_manager.get_block_ids("free") == ([1, 2],)
    assert output.scheduled_new_reqs[0].block_ids == [[3, 4]]
    assert scheduler.requests["fsm"].status == RequestStatus.RUNNING


def test_only_requests_waiting_for_grammars_still_make_a_step_that_carries_them():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("fsm", [1, 2], structured_outputs=REGEX))
    assert scheduler.has_unfinished_requests()
    output = scheduler.schedule()
    assert output.is_empty and output.grammars_to_prepare == {"fsm": REGEX}
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_grammar_that_fails_to_compile_finishes_its_request_with_the_error():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("free", [1, 2, 3], max_tokens=2))
    scheduler.add_request(make_request("fsm", [4, 5], structured_outputs=REGEX))
    output = scheduler.schedule()
    model_output = fake_model_output(scheduler, output)
    model_output.request_errors = {"fsm": "structured_outputs: invalid regex: (a"}
    outputs = scheduler.update_from_output(output, model_output)
    (error,) = [o for o in outputs.outputs if o.request_id == "fsm"]
    assert (error.finish_reason, error.error) == (
        FinishReason.ERROR,
        "structured_outputs: invalid regex: (a",
    )
    assert "fsm" not in scheduler.requests and not scheduler.waiting_for_fsm
    output, outputs = run_step(scheduler)
    assert (output.finished_req_ids, output.num_scheduled_tokens) == (["fsm"], {"free": 1})
    assert outputs.outputs[0].finish_reason == FinishReason.LENGTH  # free's second token


def test_an_abort_while_waiting_for_the_grammar_frees_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("sent", [1, 2], structured_outputs=REGEX))
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput())
    scheduler.add_request(make_request("unsent", [3, 4], structured_outputs=REGEX))
    scheduler.finish_requests(["sent", "unsent"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and not scheduler.waiting_for_fsm
    output = scheduler.schedule()
    assert sorted(output.finished_req_ids) == ["sent", "unsent"]
    assert output.grammars_to_prepare == {}  # "unsent" was never sent, and never will be
    late = ModelRunnerOutput(grammars_ready=["sent"])  # a report racing the abort
    assert scheduler.update_from_output(output, late).outputs == []
    assert not scheduler.has_unfinished_requests() and len(scheduler.waiting) == 0


def test_the_scheduler_answers_what_the_engine_core_needs_of_its_kv_pool():
    full = make_scheduler(max_model_len=64)
    assert full.num_kv_cache_groups == 1
    assert full.num_blocks_per_full_length_request == 64 // 4
    hybrid = make_scheduler(
        KVCacheConfig.for_layers([None, 8], 4, 64), max_model_len=64, max_num_batched_tokens=8
    )  # the window group holds the window plus one step's tokens, not the whole request
    assert hybrid.num_kv_cache_groups == 2
    assert 64 // 4 < hybrid.num_blocks_per_full_length_request < 2 * (64 // 4)

    log = full.enable_kv_cache_events()
    full.add_request(make_request("a", list(range(10))))
    run_step(full)
    events = log.take()
    assert events is not None and len(events.stored) == 2  # the two full blocks of 4 tokens


def test_a_request_whose_grammar_is_ready_keeps_its_arrival_place_under_fcfs():
    # One running slot: the order in which waiting requests start is the queue's order.
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("running", [1, 2], max_tokens=2, arrival_time=0.0))
    scheduler.add_request(
        make_request("fsm", [3, 4], max_tokens=1, arrival_time=1.0, structured_outputs=REGEX)
    )
    for name, arrival in (("b", 2.0), ("c", 3.0)):
        scheduler.add_request(make_request(name, [5, 6], max_tokens=1, arrival_time=arrival))
    output = scheduler.schedule()
    model_output = fake_model_output(scheduler, output)
    model_output.grammars_ready = ["fsm"]
    scheduler.update_from_output(output, model_output)
    assert [r.request_id for r in scheduler.waiting] == ["fsm", "b", "c"]
    started = []
    for _ in range(8):
        output, _ = run_step(scheduler)
        started += [r.req_id for r in output.scheduled_new_reqs]
    assert started == ["fsm", "b", "c"]
