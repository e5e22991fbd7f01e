"""The scheduler's one flat, frozen, self-validating config."""

from __future__ import annotations

from dataclasses import dataclass

from proto.engine_config import POLICIES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV pool.

    `long_prefill_token_threshold` caps the tokens one prompt gets per step (0 = only the
    budget caps it), so a long prompt cannot starve running decodes.
    `enable_chunked_prefill` False: a prompt is never split over steps; it waits for a step
    whose remaining budget holds all of it, so the budget must hold max_model_len tokens.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_gpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("block_size", self.block_size)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill:
            self._check_unchunked_prefill()

    def _check_unchunked_prefill(self) -> None:
        if self.long_prefill_token_threshold:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} chunks long "
                "prompts, which enable_chunked_prefill=False forbids"
            )
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len}: with enable_chunked_prefill=False a prompt is prefilled "
                "in one step, so the step budget must be at least max_model_len; raise "
                f"max_num_batched_tokens to {self.max_model_len}, lower max_model_len, or "
                "enable chunked prefill"
            )


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
