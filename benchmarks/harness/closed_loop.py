"""Closed-loop runs: a fixed number of requests in flight (the batch size), each timed alone.

A run sends its prompts in order, `concurrency` at a time: a request starts as soon as one of
the previous ones finishes, so the engine sees a steady batch of `concurrency` decoding
requests (all prompts at once for saturation). Per request it records when it was sent, when
its first token came and when it finished; the run's wall time covers the first send to the
last finish.

Time per output token (TPOT) is vLLM's: (finish - first token) / (output tokens - 1), per
request, for requests of at least two tokens. With speculative decoding one streamed update may
carry several tokens; TPOT still divides by the tokens, not by the updates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from benchmarks.harness.common import mean, percentiles


@dataclass(slots=True)
class RequestTiming:
    """One request of a run, in seconds of one monotonic clock; `first_token_s` is None for a
    request that produced no token."""

    start_s: float
    first_token_s: float | None
    end_s: float
    output_token_ids: list[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @classmethod
    def from_json(cls, record: dict) -> RequestTiming:
        """From a peer's record: {"start_s", "first_token_s", "end_s", "output_token_ids"};
        ValueError naming the first missing or ill-typed field."""
        for key in ("start_s", "end_s"):
            if not isinstance(record.get(key), (int, float)):
                raise ValueError(f"request record field {key!r} must be a number, got {record}")
        first = record.get("first_token_s")
        if first is not None and not isinstance(first, (int, float)):
            raise ValueError(
                f"request record field 'first_token_s' must be a number or null: {first!r}"
            )
        token_ids = record.get("output_token_ids")
        if not isinstance(token_ids, list):
            raise ValueError(
                f"request record field 'output_token_ids' must be a list: {token_ids!r}"
            )
        return cls(float(record["start_s"]), first, float(record["end_s"]), token_ids)


@dataclass(slots=True)
class ClosedLoopRun:
    """What one run measured: wall time and every request's timing, in prompt order."""

    elapsed_s: float
    requests: list[RequestTiming]

    @property
    def output_token_ids(self) -> list[list[int]]:
        return [request.output_token_ids for request in self.requests]

    def summary(self) -> dict:
        """Output tokens/s over the run's wall time; TPOT and TTFT over its requests (ms)."""
        num_tokens = sum(request.num_output_tokens for request in self.requests)
        tpots_ms = [r.tpot_s * 1e3 for r in self.requests if r.tpot_s is not None]
        ttfts_ms = [r.ttft_s * 1e3 for r in self.requests if r.ttft_s is not None]
        return {
            "num_requests": len(self.requests),
            "num_output_tokens": num_tokens,
            "elapsed_s": self.elapsed_s,
            "output_tokens_per_s": num_tokens / self.elapsed_s,
            "tpot_ms": {"mean": mean(tpots_ms), **percentiles(tpots_ms)},
            "ttft_ms": {"mean": mean(ttfts_ms), **percentiles(ttfts_ms)},
        }


async def run_closed_loop(
    send: Callable[[int], Awaitable[RequestTiming]], num_requests: int, concurrency: int
) -> ClosedLoopRun:
    """Runs `send(index)` for every index in order, at most `concurrency` at a time."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    slots = asyncio.Semaphore(concurrency)  # FIFO: requests start in prompt order

    async def in_slot(index: int) -> RequestTiming:
        async with slots:
            return await send(index)

    start = time.monotonic()
    requests = await asyncio.gather(*(in_slot(index) for index in range(num_requests)))
    return ClosedLoopRun(time.monotonic() - start, list(requests))


def first_differences(
    reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
) -> list[int | None]:
    """Per request, the first output position where `other` differs from `reference` (a
    length difference counts at the shorter length), None where they are identical."""
    if len(reference) != len(other):
        raise ValueError(f"{len(other)} outputs to compare with {len(reference)} references")
    positions: list[int | None] = []
    for expected, actual in zip(reference, other, strict=True):
        if list(expected) == list(actual):
            positions.append(None)
            continue
        shared = min(len(expected), len(actual))
        positions.append(next((i for i in range(shared) if expected[i] != actual[i]), shared))
    return positions
