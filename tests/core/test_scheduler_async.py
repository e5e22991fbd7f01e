"""Async scheduling: steps planned while the last one runs give the same tokens as one step at a
time, the KV the model reads is always the request's own history, and no request runs past its
end.

A simulated worker (`MirrorWorker`) keeps what a real one keeps: each request's token history
(the prompt, the tokens the scheduler sends back, and under async scheduling the tokens it
sampled itself), its block table, and the KV slots it wrote. Its "model" reads the KV of every
position before the one it samples at and derives the token from it, so a slot written with the
wrong token, or a cached block overwritten, changes what it samples.
"""

from __future__ import annotations

import argparse
import collections
import random
from dataclasses import dataclass, field

import pytest

from core_engine.core.request import RequestStatus
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import ModelRunnerOutput, SchedulerOutput
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.speculative_config import SpeculativeConfig
from tests.helpers.core_factories import BLOCK_SIZE, make_request, make_scheduler

EOS_TOKEN_ID = 7


@dataclass(slots=True)
class MirrorRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int = 0


@dataclass(slots=True)
class MirrorWorker:
    """Runs steps in the order they are sent, as a worker does."""

    async_scheduling: bool
    requests: dict[str, MirrorRequest] = field(default_factory=dict)
    slot_to_token: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = MirrorRequest(
                list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        for cached in output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids += cached.new_token_ids
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids[0])
            elif cached.new_block_ids:
                state.block_ids += cached.new_block_ids[0]
        model_output = ModelRunnerOutput()
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            model_output.req_ids.append(req_id)
            model_output.sampled_token_ids.append(self._run(req_id, num_tokens))
        return model_output

    def _run(self, req_id: str, num_tokens: int) -> list[int]:
        state = self.requests[req_id]
        end = state.num_computed_tokens + num_tokens
        assert end <= len(state.token_ids), f"{req_id}: scheduled past the tokens it has"
        for position in range(state.num_computed_tokens, end):
            self.slot_to_token[self._slot(state, position)] = (
                state.token_ids[position],
                position,
            )
        if end < len(state.token_ids):
            return []  # mid-prefill
        token_id = self._next_token(state, end)
        if self.async_scheduling:
            state.token_ids.append(token_id)
        return [token_id]

    def _next_token(self, state: MirrorRequest, num_tokens: int) -> int:
        """A function of the KV read back for positions 0..num_tokens-1 (an attention)."""
        read = [self.slot_to_token[self._slot(state, p)] for p in range(num_tokens)]
        assert read == [(t, p) for p, t in enumerate(state.token_ids[:num_tokens])], (
            "the KV read back is not the request's history"
        )
        return (sum(t for t, _ in read) * 31 + num_tokens) % 41 + 3

    @staticmethod
    def _slot(state: MirrorRequest, position: int) -> tuple[int, int]:
        return state.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE


def drive(scheduler: Scheduler, max_steps_in_flight: int, aborts: dict[int, str] | None = None):
    """Runs the scheduler to completion as the engine core process does: up to
    `max_steps_in_flight` steps sent before the oldest is answered; `aborts[k]` is aborted
    before the k-th step is planned. Returns each request's tokens and finish reason."""
    worker = MirrorWorker(scheduler.config.async_scheduling)
    in_flight: collections.deque = collections.deque()
    finished: dict[str, tuple[list[int], object]] = {}
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    aborts = aborts or {}
    for num_planned in range(10_000):
        if num_planned in aborts:
            scheduler.finish_requests(aborts[num_planned], RequestStatus.FINISHED_ABORTED)
        if len(in_flight) < max_steps_in_flight and scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            in_flight.append((output, worker.execute(output)))
            check_placeholders(scheduler)
            if output.total_num_scheduled_tokens and len(in_flight) < max_steps_in_flight:
                continue
        if not in_flight:
            return finished, tokens
        output, model_output = in_flight.popleft()
        for engine_output in scheduler.update_from_output(output, model_output).outputs:
            tokens[engine_output.request_id] += engine_output.new_token_ids
            if engine_output.finish_reason is not None:
                finished[engine_output.request_id] = engine_output.finish_reason
        scheduler.kv_cache_manager.block_pool.check_integrity()
    raise AssertionError("the scheduler did not finish")


def check_placeholders(scheduler: Scheduler) -> None:
    for request in scheduler.requests.values():
        assert 0 <= request.num_output_placeholders <= 2, request
        if not scheduler.config.async_scheduling:
            assert request.num_output_placeholders == 0
        if request.max_tokens is not None:
            assert request.num_output_tokens + request.num_output_placeholders <= (
                request.max_tokens
            ), f"{request} runs past max_tokens"


def random_workload(seed: int) -> list:
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(3, 40) for _ in range(rng.randrange(0, 20))]
    requests = []
    for i in range(rng.randrange(1, 9)):
        prompt = shared_prefix + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 25))]
        max_tokens = rng.choice([1, 2, 3, 8, 20, None])
        requests.append(
            make_request(
                f"r{i}",
                prompt,
                max_tokens=max_tokens,
                eos_token_id=EOS_TOKEN_ID,
                priority=rng.randrange(3),
            )
        )
    return requests


def scheduler_for(seed: int, async_scheduling: bool) -> Scheduler:
    rng = random.Random(seed)
    return make_scheduler(
        max_num_seqs=rng.choice([1, 2, 4, 16]),
        max_num_batched_tokens=rng.choice([4, 9, 64]),
        max_model_len=48,  # some requests end on it
        num_gpu_blocks=rng.choice([14, 18, 60]),  # few blocks: preemption
        enable_prefix_caching=rng.random() < 0.7,
        policy=rng.choice(["fcfs", "priority"]),
        async_scheduling=async_scheduling,
    )


@pytest.mark.parametrize("seed", range(60))
def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(seed):
    results = []
    for async_scheduling, depth in ((False, 1), (True, 2)):
        scheduler = scheduler_for(seed, async_scheduling)
        for request in random_workload(seed):
            scheduler.add_request(request)
        results.append(drive(scheduler, depth))
        assert not scheduler.requests
        assert scheduler.kv_cache_manager.usage == 0.0
    assert results[1] == results[0]


def test_a_decode_is_planned_before_the_last_token_is_back():
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=5))
    first = scheduler.schedule()
    second = scheduler.schedule()  # the prefill's token is still in flight
    assert first.num_scheduled_tokens == {"a": 10}
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs[0].num_computed_tokens == 10
    assert scheduler.requests["a"].num_output_placeholders == 2
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))
    third = scheduler.schedule()
    # The worker appended the token it sampled: nothing is sent back.
    assert third.scheduled_cached_reqs[0].new_token_ids == []
    assert scheduler.requests["a"].num_output_placeholders == 2


def test_a_request_is_not_planned_past_max_tokens_while_its_last_token_is_in_flight():
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    prefill = scheduler.schedule()
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    outputs = scheduler.update_from_output(
        prefill, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[9]])
    )
    assert outputs.outputs[0].new_token_ids == [9]
    assert not scheduler.requests


def test_a_token_sampled_after_an_early_stop_is_dropped():
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10, eos_token_id=EOS_TOKEN_ID))
    prefill = scheduler.schedule()
    extra = scheduler.schedule()
    stop = scheduler.update_from_output(
        prefill, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[EOS_TOKEN_ID]])
    )
    assert stop.outputs[0].finish_reason is not None
    late = scheduler.update_from_output(
        extra, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[11]])
    )
    assert late.outputs == []
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.schedule().finished_req_ids == ["a"]  # the workers drop its state


@pytest.mark.parametrize("seed", range(20))
def test_aborts_while_steps_are_in_flight_free_every_block(seed):
    scheduler = scheduler_for(seed, async_scheduling=True)
    workload = random_workload(seed)
    for request in workload:
        scheduler.add_request(request)
    rng = random.Random(seed)
    aborts = {rng.randrange(0, 12): request.request_id for request in workload[::2]}
    finished, _ = drive(scheduler, 2, aborts)
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.usage == 0.0
    for request_id in aborts.values():
        assert request_id not in finished or finished[request_id] is not None


@pytest.mark.parametrize(
    "flags",
    [
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        dict(kv_offloading_size=1.0),
    ],
)
def test_the_engine_config_refuses_what_reads_the_tokens_in_flight(flags):
    with pytest.raises(ValueError, match="async_scheduling cannot run with"):
        EngineConfig(async_scheduling=True, **flags)


def test_async_scheduling_is_a_cli_flag_off_by_default():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not EngineConfig.from_cli_args(parser.parse_args([])).async_scheduling


def test_async_scheduling_refuses_speculative_decoding():
    with pytest.raises(ValueError, match="async_scheduling cannot run with speculative_config"):
        SchedulerConfig(
            async_scheduling=True,
            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
        )
