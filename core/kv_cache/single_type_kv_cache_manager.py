"""Per-attention-type block bookkeeping of one KV cache group, behind the KVCacheCoordinator.

Full attention keeps every block of a request. A sliding window frees the blocks that fall out
of its window (the null block takes their place in the request's block list) and accepts a
prefix hit once the window's worth of blocks before the match point is cached.
"""

from __future__ import annotations

from collections import defaultdict

from core_engine.common.block_hash import BlockHash
from core_engine.common.math_utils import cdiv
from core_engine.core.kv_cache.block_pool import BlockPool
from core_engine.core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from core_engine.core.kv_cache.kv_cache_utils import KVCacheBlock
from core_engine.core.request import Request


class SingleTypeKVCacheManager:
    """Which blocks each request holds in one KV cache group, and how many are registered in
    the prefix cache.

    Invariant: `req_to_blocks[rid][:num_cached_block[rid]]` are hashed or null blocks; every
    non-null block in `req_to_blocks` holds one reference per occurrence.
    """

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int = 0
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Blocks this request would take from the free queue to hold `num_tokens`: new ones,
        plus hit blocks that currently sit in the free queue (touching them removes them from
        it). Null blocks, in the request's list or among the hits, cost nothing."""
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_held_blocks = len(self.req_to_blocks.get(request_id, ()))
        num_new_blocks = num_required_blocks - len(new_computed_blocks) - num_held_blocks
        num_evictable_computed_blocks = sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null
        )
        return max(num_new_blocks, 0) + num_evictable_computed_blocks

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        if not new_computed_blocks:
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id].extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(self.req_to_blocks[request_id])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's newly full blocks (up to `num_tokens`) in the prefix cache."""
        num_full_blocks = num_tokens // self.block_size
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks no later token of the request attends to (none, by default)."""

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Blocks of the longest prefix within `max_length` tokens whose KV this group has
        cached; null blocks stand for blocks the group does not need."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Hit blocks of the longest cached prefix within `max_length` tokens; stops at the
        first miss (a chained hash cannot hit after a miss)."""
        max_num_blocks = max_length // self.block_size
        computed_blocks = []
        for block_hash in block_hashes[:max_num_blocks]:
            cached_block = self.block_pool.get_cached_block(block_hash, self.kv_cache_group_id)
            if cached_block is None:
                break
            computed_blocks.append(cached_block)
        return computed_blocks


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A request's block list keeps its length; blocks wholly before the window of the next
    token to compute are the null block.

    The token at position p attends to positions `p - sliding_window + 1 .. p`, so once
    `num_computed_tokens` tokens are computed, the first
    `(num_computed_tokens - sliding_window + 1) // block_size` blocks are never read again.
    """

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int = 0
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no token from `num_computed_tokens` on attends to."""
        num_skipped_tokens = num_computed_tokens - self.sliding_window + 1
        return max(num_skipped_tokens, 0) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks now outside the window (tail first) and puts the null block in
        their place. Stops at the first null block: every block before it is null already."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(self.get_num_skipped_blocks(num_computed_tokens), len(blocks))
        null_block = self.block_pool.null_block
        removed_blocks = []
        for index in range(num_skipped_blocks - 1, -1, -1):
            if blocks[index].is_null:
                break
            removed_blocks.append(blocks[index])
            blocks[index] = null_block
        self.block_pool.free_blocks(removed_blocks)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Scans from `max_length` leftwards for a run of `cdiv(sliding_window - 1,
        block_size)` cached blocks: the window of the token after the run (minus that token
        itself). The hit ends at the run, and blocks before the run are null, cached or not.
        Without such a run, the hit is the cached blocks before the first miss."""
        num_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        run: list[KVCacheBlock] = []  # cached blocks ending at block `run_end`, last first
        run_end = max_num_blocks
        for index in range(max_num_blocks - 1, -1, -1):
            if len(run) >= num_contiguous_blocks:
                break
            cached_block = self.block_pool.get_cached_block(
                block_hashes[index], self.kv_cache_group_id
            )
            if cached_block is None:
                run.clear()
                run_end = index
            else:
                run.append(cached_block)
        # A short run that reached block 0 is a whole prefix: then run_end == len(run).
        num_null_blocks = run_end - len(run)
        return [self.block_pool.null_block] * num_null_blocks + run[::-1]


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, kv_cache_group_id)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, kv_cache_group_id)
    raise TypeError(f"no KV cache manager for {kv_cache_spec!r}")
