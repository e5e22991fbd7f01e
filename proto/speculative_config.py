"""`SpeculativeConfig`: how the engine drafts tokens for one forward pass to verify.

The fields and their meaning are vLLM's `speculative_config` for its draft-model-free methods:
- "ngram" (prompt lookup): the longest suffix of the request's tokens, between
  `prompt_lookup_min` and `prompt_lookup_max` tokens long, that occurred earlier in the request
  proposes up to `num_speculative_tokens` tokens that followed it (fewer while a request's drafts
  keep failing: `core.spec_decode.draft_length`).
- "suffix" (suffix decoding): a suffix tree per request plus a global one over earlier
  requests' outputs propose a continuation whose length follows the match:
  at most `suffix_decoding_max_spec_factor` x the matched length, at most
  `num_speculative_tokens`, and only while the continuation's estimated probability stays at
  or above `suffix_decoding_min_token_prob`.

Drafting stops for a step whose running batch holds `disable_by_batch_size` requests or more:
verifying drafts costs a forward over K+1 positions per request, which pays off only while a
step is bound by reading the weights rather than by arithmetic. Unlike vLLM (never), the default
is DEFAULT_DISABLE_BY_BATCH_SIZE, measured on a 2-core AVX2 CPU with the default model
(benchmarks/results/avx2/spec_decode.md): copy-heavy chats gained 1.14x output tok/s with n-gram
drafts at 16 requests in flight and lost 0.92x at 32; None drafts at any batch size.
"""

from __future__ import annotations

from typing import Any

import msgspec

from core_engine.proto.json_struct import parse_json_struct

SPECULATIVE_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Validated on construction (and so on decode); every error names the field and its limit."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        _check(
            self.method in SPECULATIVE_METHODS,
            f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        k = self.num_speculative_tokens
        _check(
            k is None or 1 <= k <= MAX_SPECULATIVE_TOKENS,
            f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
            f"got {k}",
        )
        _check(
            self.method == "suffix" or k is not None,
            "speculative_config.num_speculative_tokens is required for method 'ngram'",
        )
        self._check_ngram_window()
        _check(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 2,
            "speculative_config.disable_by_batch_size must be at least 2 (None: never), "
            f"got {self.disable_by_batch_size}",
        )
        self._check_suffix_limits()

    def _check_ngram_window(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _check(
                value is None or value >= 1,
                f"speculative_config.{name} must be at least 1, got {value}",
            )
        _check(
            low is None or high is None or low <= high,
            f"speculative_config.prompt_lookup_min={low} is above prompt_lookup_max={high}",
        )

    def _check_suffix_limits(self) -> None:
        _check(
            self.suffix_decoding_max_tree_depth >= 1,
            "speculative_config.suffix_decoding_max_tree_depth must be at least 1, "
            f"got {self.suffix_decoding_max_tree_depth}",
        )
        _check(
            self.suffix_decoding_max_cached_requests >= 0,
            "speculative_config.suffix_decoding_max_cached_requests must be >= 0, "
            f"got {self.suffix_decoding_max_cached_requests}",
        )
        _check(
            self.suffix_decoding_max_spec_factor > 0,
            "speculative_config.suffix_decoding_max_spec_factor must be positive, "
            f"got {self.suffix_decoding_max_spec_factor}",
        )
        _check(
            0.0 <= self.suffix_decoding_min_token_prob <= 1.0,
            "speculative_config.suffix_decoding_min_token_prob must be in [0, 1], "
            f"got {self.suffix_decoding_min_token_prob}",
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """The most draft tokens one request gets per step (the slots the scheduler reserves)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return min(self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS)

    @property
    def ngram_window(self) -> tuple[int, int]:
        """(min, max) n-gram lengths matched; vLLM's defaults fill what is unset."""
        high = self.prompt_lookup_max
        low = self.prompt_lookup_min
        if high is None:
            high = max(low or 0, 5)
        if low is None:
            low = min(high, 2)
        return low, high

    def describe(self) -> str:
        """The start-up log line: the method, K, and when drafting stops."""
        k = self.num_lookahead_tokens
        if self.method == "ngram":
            low, high = self.ngram_window
            how = f"ngram (prompt lookup of {low}-{high} tokens), up to K={k} draft tokens"
        else:
            how = (
                f"suffix, up to K={k} draft tokens (tree depth "
                f"{self.suffix_decoding_max_tree_depth}, {self.suffix_decoding_max_spec_factor:g}x "
                f"the match, token probability >= {self.suffix_decoding_min_token_prob:g})"
            )
        limit = self.disable_by_batch_size
        when = "in every step" if limit is None else f"in steps of fewer than {limit} requests"
        return f"speculative decoding: {how} per request, {when}"

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a config, a dict, or JSON text (the CLI flag); None stays None.

        Raises ValueError naming the field that is wrong."""
        return parse_json_struct(cls, value, "speculative_config")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
