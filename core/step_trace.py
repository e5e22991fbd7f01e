"""`StepTrace`: one line per engine step, for finding where serving time goes.

With CORE_ENGINE_STEP_TRACE=PATH the engine core appends one JSON line per step to PATH:
when it sent the step to the workers and when rank 0's answer came (`time.monotonic()`
seconds), how many tokens and requests it scheduled and how many of those requests ran a single
token (decodes). A step's wall time is `received - sent`; the gap before a step is its `sent`
minus the previous step's `received` (the core's own work: outputs, new requests, scheduling).
Off by default: then `record` is never called.
"""

from __future__ import annotations

import os
from typing import TextIO

import msgspec

from core_engine.proto import SchedulerOutput

STEP_TRACE_ENV = "CORE_ENGINE_STEP_TRACE"


class StepRecord(msgspec.Struct, frozen=True):
    sent_s: float
    received_s: float
    num_tokens: int
    num_reqs: int
    num_decode_reqs: int


class StepTrace:
    """Appends `StepRecord`s as JSON lines to an open file, flushed per line."""

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._encoder = msgspec.json.Encoder()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(STEP_TRACE_ENV)
        return cls(open(path, "a", encoding="utf-8")) if path else None  # noqa: SIM115

    def record(self, scheduler_output: SchedulerOutput, sent_s: float, received_s: float) -> None:
        counts = scheduler_output.num_scheduled_tokens
        record = StepRecord(
            sent_s=sent_s,
            received_s=received_s,
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_reqs=len(counts),
            num_decode_reqs=sum(1 for count in counts.values() if count == 1),
        )
        self._file.write(self._encoder.encode(record).decode() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
