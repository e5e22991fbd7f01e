"""The scheduler's side of speculative decoding, driven with hand-built model outputs: drafts
in the budget and the KV slots, rollback of rejected drafts, stop checks inside an accepted
run, limits, chunked prefill, preemption, the prefix cache, and the counters."""

from __future__ import annotations

import random

import pytest

from core_engine.common.math_utils import cdiv
from core_engine.core.kv_cache.kv_cache_utils import make_block_hash_with_group_id
from core_engine.core.request import RequestStatus
from core_engine.proto import FinishReason, ModelRunnerOutput, TokenLogprobs
from core_engine.proto.speculative_config import SpeculativeConfig
from tests.helpers.core_factories import (
    BLOCK_SIZE,
    check_spec_decode_integrity,
    make_request,
    make_scheduler,
    scheduled_req_ids,
)

PERIOD = [5, 6, 7, 8, 9]  # a periodic prompt: n-gram drafts of the period are exact


def _ngram(k=3, **kwargs):
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                             prompt_lookup_max=3, **kwargs)  # fmt: skip


def _periodic_model(request, token_ids):
    """The 'model': the token after `token_ids` continues the period."""
    return PERIOD[len(token_ids) % len(PERIOD)]


def verify(scheduler, scheduler_output, model=_periodic_model, logprobs=False):
    """What a greedy verifying worker returns: for each request whose scheduled tokens reach
    its end, the drafts the model agrees with, then the model's own token."""
    req_ids = scheduled_req_ids(scheduler_output)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
        if request.num_computed_tokens < request.num_tokens + len(drafts):
            sampled.append([])  # mid-prefill
            continue
        token_ids = list(request.all_token_ids)
        tokens = []
        for draft in drafts:
            tokens.append(model(request, token_ids))
            if tokens[-1] != draft:
                break
            token_ids.append(draft)
        else:
            tokens.append(model(request, token_ids))
        sampled.append(tokens)
    token_logprobs = None
    if logprobs:
        token_logprobs = [
            [TokenLogprobs(-float(t), 1, [], []) for t in tokens] for tokens in sampled
        ]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=token_logprobs)


def step(scheduler, model=_periodic_model, logprobs=False):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        scheduler_output, verify(scheduler, scheduler_output, model, logprobs)
    )
    check_spec_decode_integrity(scheduler)
    scheduler.kv_cache_manager.check_integrity()
    return scheduler_output, {o.request_id: o for o in outputs.outputs}


def _periodic_prompt(length):
    return [PERIOD[i % len(PERIOD)] for i in range(length)]


def test_drafts_follow_the_prompt_and_count_in_the_budget():
    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20))
    prefill, outputs = step(scheduler)
    assert prefill.scheduled_spec_decode_tokens == {}  # no drafts before the prompt is done
    assert outputs["a"].new_token_ids == [7]
    verify_step, outputs = step(scheduler)
    # Last 3 tokens (6, 7, ... ) -> the tokens that followed their earliest occurrence.
    assert verify_step.scheduled_spec_decode_tokens == {"a": [8, 9, 5]}
    assert verify_step.num_scheduled_tokens == {"a": 4}
    assert verify_step.total_num_scheduled_tokens == 4
    assert outputs["a"].new_token_ids == [8, 9, 5, 6]  # all accepted, plus the bonus token
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1 == 11
    assert scheduler.get_stats().num_generation_tokens == 5


def test_budget_cuts_drafts_and_the_slots_cover_the_drafts_kept():
    scheduler = make_scheduler(speculative_config=_ngram(k=4), max_num_batched_tokens=3)
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=30))
    while scheduler.requests["a"].num_output_tokens == 0:  # a chunked prefill: 3 + 3 + 1
        step(scheduler)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [8, 9]}
    request = scheduler.requests["a"]
    # Slots for every computed token, through the last draft of the step, were allocated.
    block_ids = scheduler.kv_cache_manager.get_block_ids("a")[0]
    assert len(block_ids) >= cdiv(request.num_computed_tokens, BLOCK_SIZE)


def test_drafts_get_slots_in_the_blocks_they_reach():
    scheduler = make_scheduler(speculative_config=_ngram(k=4))
    scheduler.add_request(make_request("a", _periodic_prompt(8), max_tokens=30))
    step(scheduler)  # prefill: 8 tokens, 2 blocks; one token out
    output = scheduler.schedule()
    drafts = output.scheduled_spec_decode_tokens["a"]
    assert len(drafts) == 4
    # Tokens 0..8 are real, 9..12 drafts: 13 slots, 4 blocks of 4.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == cdiv(9 + 4, BLOCK_SIZE)


def test_partial_acceptance_rolls_back_the_rejected_positions():
    def model(request, token_ids):  # disagrees with the period at output token 3
        if len(token_ids) == request.num_prompt_tokens + 2:
            return 0
        return _periodic_model(request, token_ids)

    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20))
    step(scheduler, model)
    output, outputs = step(scheduler, model)
    assert output.scheduled_spec_decode_tokens["a"] == [8, 9, 5]
    # Draft 8 accepted, 9 rejected: the model's 0 takes its place; 5 is never looked at.
    assert outputs["a"].new_token_ids == [8, 0]
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 8, 0]
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = scheduler.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 3)
    assert stats.spec_decode_num_accepted_tokens == 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]
    following = scheduler.schedule()
    (cached,) = following.scheduled_cached_reqs
    assert cached.num_computed_tokens == 9  # the worker resumes after the accepted draft
    assert cached.new_token_ids == [8, 0]


@pytest.mark.parametrize("stop", ["eos", "stop_token"])
def test_a_stop_token_inside_the_accepted_run_ends_the_request_there(stop):
    kwargs = {"eos_token_id": 9} if stop == "eos" else {"stop_token_ids": [9]}
    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    prompt = [5, 6, 7, 8, 1, 2, 5, 6]  # drafts after "5 6": 7, 8, 1 (earliest occurrence)
    scheduler.add_request(make_request("a", prompt, max_tokens=20, **kwargs))

    def model(request, token_ids):
        return {8: 7, 9: 8, 10: 9}.get(len(token_ids), 3)

    step(scheduler, model)
    output, outputs = step(scheduler, model)
    assert output.scheduled_spec_decode_tokens["a"] == [8, 1, 2]
    assert outputs["a"].new_token_ids == [8, 9]  # 8 accepted, then 9 where 1 stood: stop
    assert outputs["a"].finish_reason == FinishReason.STOP
    assert outputs["a"].stop_reason == (9 if stop == "stop_token" else None)
    assert "a" not in scheduler.requests


def test_eos_among_accepted_drafts_stops_before_the_rest():
    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20, eos_token_id=9))
    step(scheduler)
    output, outputs = step(scheduler)
    assert output.scheduled_spec_decode_tokens["a"] == [8, 9, 5]
    assert outputs["a"].new_token_ids == [8, 9]  # the worker accepted 8, 9, 5 and a bonus
    assert outputs["a"].finish_reason == FinishReason.STOP


def test_drafts_never_reach_past_max_tokens_or_max_model_len():
    scheduler = make_scheduler(speculative_config=_ngram(k=4), max_model_len=13)
    scheduler.add_request(make_request("short", _periodic_prompt(5), max_tokens=3))
    scheduler.add_request(make_request("long", _periodic_prompt(10), max_tokens=None))
    step(scheduler)  # both prefill, one token each
    output, outputs = step(scheduler)
    # "short": 1 of 3 out, 2 to go, one of them after the drafts; "long": 11 of 13 tokens.
    assert output.scheduled_spec_decode_tokens == {"short": [6], "long": [6]}
    assert outputs["short"].new_token_ids == [6, 7]
    assert outputs["short"].finish_reason == FinishReason.LENGTH
    assert outputs["long"].new_token_ids == [6, 7]
    assert outputs["long"].finish_reason == FinishReason.LENGTH
    assert not scheduler.has_unfinished_requests()


def test_no_drafts_while_the_prompt_is_chunked():
    scheduler = make_scheduler(speculative_config=_ngram(k=3), max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", _periodic_prompt(10), max_tokens=6))
    drafted = []
    for _ in range(6):
        output, _ = step(scheduler)
        drafted.append(bool(output.scheduled_spec_decode_tokens))
    assert drafted[:3] == [False, False, False]  # 4 + 4 + 2 prompt tokens
    assert drafted[3] is True


def test_logprobs_are_those_of_the_kept_tokens():
    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=3, logprobs=0))
    step(scheduler, logprobs=True)
    _, outputs = step(scheduler, logprobs=True)
    assert outputs["a"].new_token_ids == [8, 9]  # max_tokens 3: drafts cut to 1, plus bonus
    assert [lp.sampled_logprob for lp in outputs["a"].new_logprobs] == [-8.0, -9.0]


def test_disable_by_batch_size_turns_drafting_off_for_the_whole_batch():
    scheduler = make_scheduler(speculative_config=_ngram(k=2, disable_by_batch_size=2))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=30))
    step(scheduler)
    output, _ = step(scheduler)
    assert output.scheduled_spec_decode_tokens == {"a": [8, 9]}
    scheduler.add_request(make_request("b", _periodic_prompt(6), max_tokens=30))
    output, _ = step(scheduler)  # "a" drafts (it runs alone) as "b" joins
    assert list(output.scheduled_spec_decode_tokens) == ["a"]
    output, _ = step(scheduler)  # two running: nobody drafts
    assert output.scheduled_spec_decode_tokens == {}
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert list(output.scheduled_spec_decode_tokens) == ["b"]


def test_a_full_pool_cuts_drafts_instead_of_preempting():
    # 7 usable blocks: "a" (9 prompt tokens) holds 3, "b" (13) holds 4.
    scheduler = make_scheduler(speculative_config=_ngram(k=4), num_gpu_blocks=8,
                               max_model_len=28, enable_prefix_caching=False)  # fmt: skip
    scheduler.add_request(make_request("a", _periodic_prompt(9), max_tokens=10))
    scheduler.add_request(make_request("b", _periodic_prompt(13), max_tokens=10))
    step(scheduler)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    output, _ = step(scheduler)
    # "a": 9 computed of 10, 12 slots: room for 2 drafts; "b": 13 of 14, 16 slots: 2.
    assert output.num_scheduled_tokens == {"a": 3, "b": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [5, 6], "b": [9, 5]}
    assert output.preempted_req_ids == []
    assert scheduler.num_preemptions == 0


def test_preemption_drops_drafts_and_the_resumed_request_recomputes_first():
    scheduler = make_scheduler(speculative_config=_ngram(k=4), num_gpu_blocks=8,
                               max_model_len=28, enable_prefix_caching=False)  # fmt: skip
    scheduler.add_request(make_request("a", _periodic_prompt(12), max_tokens=16))
    scheduler.add_request(make_request("b", _periodic_prompt(8), max_tokens=16))
    preempted_at = None
    for index in range(40):
        output, _ = step(scheduler)
        if output.preempted_req_ids and preempted_at is None:
            preempted_at = index
            (victim,) = output.preempted_req_ids
            assert victim not in output.scheduled_spec_decode_tokens
            assert scheduler.requests[victim].spec_token_ids == []
        readmitted = [r.req_id for r in output.scheduled_cached_reqs if r.resumed_from_preemption]
        assert not set(readmitted) & set(output.scheduled_spec_decode_tokens)
        if not scheduler.has_unfinished_requests():
            break
    assert preempted_at is not None
    assert not scheduler.has_unfinished_requests()


def test_rejected_drafts_never_reach_the_prefix_cache():
    def model(request, token_ids):  # the period once, then rejects every draft
        return 7 if len(token_ids) == 7 else 1

    scheduler = make_scheduler(speculative_config=_ngram(k=4))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20))
    step(scheduler, model)
    output, outputs = step(scheduler, model)
    assert output.scheduled_spec_decode_tokens["a"] == [8, 9, 5, 6]  # positions 8..11
    assert outputs["a"].new_token_ids == [1]
    request = scheduler.requests["a"]
    assert request.num_tokens == 9
    pool = scheduler.kv_cache_manager.block_pool
    blocks = scheduler.kv_cache_manager.coordinator.get_blocks("a")[0]
    hashed = [block.block_hash for block in blocks if block.block_hash is not None]
    # Only the two blocks of real tokens 0..7; the block of drafts 8..11 holds no hash.
    assert hashed == [make_block_hash_with_group_id(h, 0) for h in request.block_hashes[:2]]
    assert len(pool.cached_block_hash_to_block) == 2


def test_a_worker_returning_tokens_that_are_not_the_drafts_is_an_error():
    scheduler = make_scheduler(speculative_config=_ngram(k=2))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20))
    step(scheduler)
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens["a"] == [8, 9]
    bad = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[8, 1, 2]])
    with pytest.raises(RuntimeError, match=r"verified drafts \[8, 9\]"):
        scheduler.update_from_output(output, bad)


def test_an_abort_while_drafts_are_verified_leaves_nothing_behind():
    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=20))
    step(scheduler)
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens["a"]
    runner_output = verify(scheduler, output)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(output, runner_output).outputs == []
    check_spec_decode_integrity(scheduler)
    assert scheduler.drafter.proposer.num_tracked_requests == 0
    assert scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_speculation_changes_no_token_under_pressure(seed):
    """Same greedy tokens with and without drafts: chunked prefill, a tiny pool with
    preemption, prefix hits and stop tokens, with a model that copies but not always."""
    rng = random.Random(seed)
    shared = [rng.randrange(6) for _ in range(8)]  # two blocks: prefix hits
    prompts = [shared + [rng.randrange(6) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]

    def model(request, token_ids):
        # Mostly repeats the token 3 back (drafts often right), sometimes not.
        mixed = (sum(token_ids[-4:]) * 7 + len(token_ids)) % 11
        return token_ids[-3] if mixed < 8 and len(token_ids) >= 3 else mixed % 6

    def run(speculative_config):
        scheduler = make_scheduler(speculative_config=speculative_config, num_gpu_blocks=12,
                                   max_model_len=40, max_num_batched_tokens=10,
                                   max_num_seqs=4)  # fmt: skip
        for index, prompt in enumerate(prompts):
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=max_tokens[index],
                                               stop_token_ids=[5]))  # fmt: skip
        tokens = {f"r{index}": [] for index in range(len(prompts))}
        for _ in range(400):
            if not scheduler.has_unfinished_requests():
                break
            _, outputs = step(scheduler, model)
            for request_id, output in outputs.items():
                tokens[request_id].extend(output.new_token_ids)
        assert not scheduler.has_unfinished_requests()
        return tokens, scheduler.get_stats()

    plain, _ = run(None)
    speculative, stats = run(_ngram(k=3))
    assert speculative == plain
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
