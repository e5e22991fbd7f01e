"""Per-request sampling and stopping parameters, validated on construction and on decode."""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False):
    """How to sample one request and when to stop it.

    Contract: every instance that exists has passed `__post_init__`, whether it was built in
    Python or decoded off the wire (msgspec calls `__post_init__` after decoding and turns its
    `ValueError` into a `msgspec.ValidationError`). `top_k == 0` and `top_p == 1.0` and
    `min_p == 0.0` disable those filters; `temperature == 0.0` means greedy.
    `max_tokens=None` means "up to the model's context window".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k >= 0 or self.top_k == -1,
            f"top_k must be >= 0 (0 disables), got {self.top_k}",
        )
        if self.top_k == -1:
            self.top_k = 0
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative, got {self.stop_token_ids}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
