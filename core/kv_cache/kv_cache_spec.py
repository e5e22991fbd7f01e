"""What each KV cache group of a model attends to (full attention or a sliding window), and the
frozen config of a model's groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core_engine.common.kv_cache_groups import group_layers


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """The group's layers attend to every earlier token."""

    block_size: int

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """The group's layers attend to the last `sliding_window` tokens, the query's own included:
    the token at position p needs the KV of positions `p - sliding_window + 1 .. p`."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The KV cache groups of one model, one spec per group (group id = index). Every group
    draws its blocks from one shared BlockPool, so all groups share one block size."""

    kv_cache_groups: tuple[KVCacheSpec, ...]
    max_model_len: int

    def __post_init__(self) -> None:
        if not self.kv_cache_groups:
            raise ValueError("a KV cache config needs at least one group, got none")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        first_block_size = self.kv_cache_groups[0].block_size
        for group_id, spec in enumerate(self.kv_cache_groups):
            if max(spec.block_size, first_block_size) % min(spec.block_size, first_block_size):
                raise ValueError(
                    f"KV cache group {group_id} has block_size={spec.block_size}, which does not "
                    f"divide and is not a multiple of group 0's block_size={first_block_size}; "
                    "all groups must share one block size"
                )
            if spec.block_size != first_block_size:
                raise ValueError(
                    f"KV cache group {group_id} has block_size={spec.block_size} but group 0 has "
                    f"block_size={first_block_size}: all groups must share one block size"
                )
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window > self.max_model_len:
                raise ValueError(
                    f"KV cache group {group_id} has sliding_window={spec.sliding_window}, larger than "
                    f"max_model_len={self.max_model_len}; use a FullAttentionSpec for it"
                )

    @classmethod
    def full_attention(cls, block_size: int, max_model_len: int) -> KVCacheConfig:
        """One full-attention group: every model that is not hybrid."""
        return cls((FullAttentionSpec(block_size),), max_model_len)

    @classmethod
    def for_layers(
        cls,
        layer_sliding_windows: Sequence[int | None],
        block_size: int,
        max_model_len: int,
        hybrid: bool = True,
    ) -> KVCacheConfig:
        """The groups of a model whose layer i attends to `layer_sliding_windows[i]` tokens
        (None: all; no layers: one full-attention group), as `group_layers` cuts them (one
        full-attention group when not `hybrid`). A window wider than max_model_len is clipped to
        it (it then frees nothing, as full attention)."""
        if not layer_sliding_windows:
            return cls.full_attention(block_size, max_model_len)
        specs: list[KVCacheSpec] = []
        for group in group_layers(layer_sliding_windows, hybrid):
            if group.sliding_window is None:
                specs.append(FullAttentionSpec(block_size))
            else:
                window = min(group.sliding_window, max_model_len)
                specs.append(SlidingWindowSpec(block_size, window))
        return cls(tuple(specs), max_model_len)

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].block_size

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
