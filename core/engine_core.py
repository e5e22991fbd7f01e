"""`EngineCore`: the scheduler and the model executor, advanced one step at a time.

No sockets and no threads here (see `EngineCoreProc` for those), so it runs in-process in tests.
"""

from __future__ import annotations

import time
from typing import Protocol

from core.request import Request, RequestStatus
from core.scheduler import Scheduler
from proto import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)


class ModelExecutor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Steps `scheduler` with `executor`; not thread-safe (only the busy loop calls it).

    Contract: every request passed to `add_request` ends in exactly one way: an error output
    returned by `add_request` (rejected), one finished output from `step` (stop, length), or
    `abort_requests` (no output: whoever aborted it already knows).
    """

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: Request) -> EngineCoreOutput | None:
        """Queues `request`; returns an ERROR output instead if the scheduler refuses it."""
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            return make_error_output(request.request_id, f"request rejected: {exc}")
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        """Frees the requests' blocks now; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def has_work(self) -> bool:
        """True while a request is unfinished.

        Finished ids alone are no reason for a step: they ride along with the next step's
        `SchedulerOutput`, so a finishing request costs no extra round trip to the workers
        (which keep its state a little longer, until that step).
        """
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs | None:
        """Schedules, executes and applies one step; None when there was nothing to do."""
        if not self.has_work:
            return None
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        """False (and nothing changes) while any request holds KV blocks."""
        return self.scheduler.reset_prefix_cache()


def make_request(core_request: EngineCoreRequest, block_size: int, vocab_size: int) -> Request:
    """The scheduler's `Request` for a wire request; hashes its full prompt blocks (slow part).

    Raises ValueError for a token id outside [0, vocab_size) (the frontend never makes one; a
    raw client might, and the model would fail on it).
    """
    token_ids = core_request.prompt_token_ids
    if token_ids and min(token_ids) < 0:
        raise ValueError(f"prompt token ids must be >= 0, got {min(token_ids)}")
    if token_ids and max(token_ids) >= vocab_size:
        raise ValueError(
            f"prompt token id {max(token_ids)} is out of range: the vocabulary has {vocab_size} tokens"
        )
    return Request(
        request_id=core_request.request_id,
        prompt_token_ids=core_request.prompt_token_ids,
        sampling_params=core_request.sampling_params,
        eos_token_id=core_request.eos_token_id,
        arrival_time=core_request.arrival_time or None,
        priority=core_request.priority,
        block_size=block_size,
    )


def make_error_output(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], FinishReason.ERROR, error=message)


def make_outputs(outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=outputs, timestamp=time.time())
