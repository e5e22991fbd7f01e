"""The workload of `bench_pd_disaggregation`: decode streams that run throughout, and long
prompts that arrive on a fixed schedule while they run.

Every request is token ids (exact lengths), seeded, greedy and ignore_eos, so each arm of the
benchmark does exactly the same work and must produce the same tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.harness.common import StreamedCompletion, exact_length_prompt, mean, percentiles

DECODE = "decode"
LONG = "long"


@dataclass(slots=True, frozen=True)
class WorkloadShape:
    """`num_decode_streams` requests with short prompts and long outputs, all sent at 0 s;
    `num_long_prompts` requests with long prompts and short outputs, the i-th sent at
    `first_long_offset_s + i * long_interval_s`. Token ranges are closed and uniform."""

    num_decode_streams: int
    decode_prompt_tokens: tuple[int, int]
    decode_output_tokens: tuple[int, int]
    num_long_prompts: int
    long_prompt_tokens: tuple[int, int]
    long_output_tokens: int
    first_long_offset_s: float
    long_interval_s: float

    def __post_init__(self) -> None:
        for name in ("decode_prompt_tokens", "decode_output_tokens", "long_prompt_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")
        if self.num_decode_streams < 1 or self.num_long_prompts < 0:
            raise ValueError(
                f"need at least one decode stream and no negative count of long prompts, got "
                f"{self.num_decode_streams} and {self.num_long_prompts}"
            )
        if self.first_long_offset_s < 0 or self.long_interval_s <= 0:
            raise ValueError(
                f"first_long_offset_s must be >= 0 and long_interval_s > 0, got "
                f"{self.first_long_offset_s} and {self.long_interval_s}"
            )

    @property
    def max_tokens_per_request(self) -> int:
        """The longest prompt plus output any request of this shape needs."""
        return max(
            self.decode_prompt_tokens[1] + self.decode_output_tokens[1],
            self.long_prompt_tokens[1] + self.long_output_tokens,
        )


FULL_SHAPE = WorkloadShape(
    num_decode_streams=6,
    decode_prompt_tokens=(16, 48),
    decode_output_tokens=(384, 512),
    num_long_prompts=8,
    long_prompt_tokens=(1000, 1500),
    long_output_tokens=8,
    first_long_offset_s=2.0,
    long_interval_s=2.5,
)
QUICK_SHAPE = WorkloadShape(
    num_decode_streams=3,
    decode_prompt_tokens=(8, 24),
    decode_output_tokens=(48, 64),
    num_long_prompts=3,
    long_prompt_tokens=(300, 400),
    long_output_tokens=4,
    first_long_offset_s=0.3,
    long_interval_s=0.5,
)


@dataclass(slots=True, frozen=True)
class TimedRequest:
    """One request of the workload: its kind (DECODE or LONG), when it is sent (seconds after
    the run's start), its prompt and its exact output length."""

    kind: str
    offset_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def build_workload(
    shape: WorkloadShape, encode: Callable[[str], list[int]], seed: int
) -> list[TimedRequest]:
    """The decode streams first, then the long prompts in arrival order; seeded by `seed`."""
    rng = random.Random(f"pd-{seed}")
    requests = [
        TimedRequest(
            DECODE,
            0.0,
            tuple(exact_length_prompt(rng, encode, rng.randint(*shape.decode_prompt_tokens))),
            rng.randint(*shape.decode_output_tokens),
        )
        for _ in range(shape.num_decode_streams)
    ]
    requests += [
        TimedRequest(
            LONG,
            shape.first_long_offset_s + index * shape.long_interval_s,
            tuple(exact_length_prompt(rng, encode, rng.randint(*shape.long_prompt_tokens))),
            shape.long_output_tokens,
        )
        for index in range(shape.num_long_prompts)
    ]
    return requests


def warm_up_prompt(shape: WorkloadShape, encode: Callable[[str], list[int]]) -> list[int]:
    """A prompt as long as the longest long prompt, sharing no block with the workload's."""
    return exact_length_prompt(random.Random("pd-warm-up"), encode, shape.long_prompt_tokens[1])


# ---- statistics --------------------------------------------------------------------------------


def tpot_s(result: StreamedCompletion) -> float:
    """Time per output token after the first: the span of the streamed chunks over the tokens
    after the first (NaN for fewer than two tokens or chunks)."""
    times = result.chunk_times_s or []
    if result.num_output_tokens < 2 or len(times) < 2:
        return float("nan")
    return (times[-1] - times[0]) / (result.num_output_tokens - 1)


def latency_stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99, max and mean, in milliseconds (NaN for no values)."""
    stats = {key: value * 1e3 for key, value in percentiles(values_s).items()}
    stats["max"] = max(values_s) * 1e3 if values_s else float("nan")
    stats["mean"] = mean(values_s) * 1e3
    return stats


def decode_stream_stats(results: Sequence[StreamedCompletion]) -> dict:
    """Inter-token latency (the gaps between streamed chunks of every stream: the stalls are in
    its tail), TPOT and TTFT of the decode streams that did not fail."""
    ok = [result for result in results if result.error is None]
    return {
        "itl_ms": latency_stats_ms([gap for result in ok for gap in result.inter_chunk_s]),
        "tpot_ms": latency_stats_ms([t for t in map(tpot_s, ok) if not math.isnan(t)]),
        "ttft_ms": latency_stats_ms([result.ttft_s for result in ok]),
    }


def long_prompt_stats(results: Sequence[StreamedCompletion]) -> dict:
    ok = [result for result in results if result.error is None]
    return {"ttft_ms": latency_stats_ms([result.ttft_s for result in ok])}


def num_long_prompts_during_decode(
    decode: Sequence[StreamedCompletion], long: Sequence[StreamedCompletion]
) -> int:
    """Long prompts whose first token came while every decode stream was still running: their
    prompt was computed (one instance) or pulled and finished (the decode instance) beside the
    streams, so any stall it caused is in the streams' ITL. Fewer than all means the streams
    were too short for this machine's speed, or the long prompts queued too long."""
    first_decode_end_s = min(result.end_s for result in decode)
    return sum(
        bool(result.chunk_times_s) and result.chunk_times_s[0] < first_decode_end_s
        for result in long
    )


def text_mismatches(reference: Sequence[str], texts: Sequence[str]) -> list[dict]:
    """For each position where the texts differ: its index and the first differing character."""
    if len(reference) != len(texts):
        raise ValueError(f"cannot compare {len(texts)} texts with {len(reference)} references")
    mismatches = []
    for index, (expected, got) in enumerate(zip(reference, texts, strict=True)):
        if expected != got:
            position = next(
                (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                min(len(expected), len(got)),
            )
            mismatches.append({"request": index, "first_differing_char": position})
    return mismatches
