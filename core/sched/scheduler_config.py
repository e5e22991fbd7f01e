"""The scheduler's one flat, frozen, self-validating config."""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.common.config_error import ConfigError
from core_engine.common.math_utils import cdiv
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from core_engine.proto.engine_config import POLICIES
from core_engine.proto.speculative_config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV pool.

    `long_prefill_token_threshold` caps the tokens one prompt gets per step (0 = only the
    budget caps it), so a long prompt cannot starve running decodes.
    `enable_chunked_prefill` False: a prompt is never split over steps; it waits for a step
    whose remaining budget holds all of it, so the budget must hold max_model_len tokens.
    `speculative_config`: how running requests draft tokens to verify (None: they do not).
    `max_loras`: most distinct LoRA adapters among running requests (0: LoRA off).
    `async_scheduling`: a step may be planned while the previous one runs (output
    placeholders stand for its tokens; see `Scheduler`).
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
    speculative_config: SpeculativeConfig | None = None
    max_loras: int = 0
    async_scheduling: bool = False

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
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "async_scheduling cannot run with speculative_config: drafts are proposed from "
                "the tokens of the step in flight"
            )

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


def check_pool_holds_one_request(config: SchedulerConfig, kv_cache_config: KVCacheConfig) -> None:
    """A request of max_model_len tokens must fit in every group at once, or it could only
    ever preempt itself. A sliding-window group holds at most its window plus one step's
    tokens (the blocks before are freed as the request advances)."""
    num_blocks_needed = blocks_per_full_length_request(config, kv_cache_config.kv_cache_groups)
    num_groups = kv_cache_config.num_groups
    in_groups = f" in its {num_groups} KV cache groups" if num_groups > 1 else ""
    if config.num_gpu_blocks - 1 < num_blocks_needed:
        raise ConfigError(
            f"num_gpu_blocks={config.num_gpu_blocks} cannot hold one request of max_model_len="
            f"{config.max_model_len} tokens{in_groups} ({num_blocks_needed} blocks of "
            f"{config.block_size} plus the null block); lower max_model_len or give the KV cache "
            "more memory"
        )


def blocks_per_full_length_request(config: SchedulerConfig, groups: list[KVCacheSpec]) -> int:
    """Blocks one request of max_model_len tokens holds at once in all of `groups`."""
    return sum(max_blocks_per_request(spec, config) for spec in groups)


def max_blocks_per_request(spec: KVCacheSpec, config: SchedulerConfig) -> int:
    """The most blocks one request of max_model_len tokens holds at once in a group of `spec`."""
    num_blocks_full = cdiv(config.max_model_len, config.block_size)
    if isinstance(spec, SlidingWindowSpec):
        num_tokens_in_reach = spec.sliding_window - 1 + config.max_num_batched_tokens
        return min(num_blocks_full, cdiv(num_tokens_in_reach, config.block_size) + 1)
    return num_blocks_full
