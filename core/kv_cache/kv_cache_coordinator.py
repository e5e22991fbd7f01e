"""One SingleTypeKVCacheManager per KV cache group, all drawing from one BlockPool."""

from __future__ import annotations

from collections import Counter

from core_engine.common.block_hash import BlockHash
from core_engine.core.kv_cache.block_pool import BlockPool, BlockPoolIntegrityError
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_cache.kv_cache_utils import KVCacheBlock, get_group_id
from core_engine.core.kv_cache.single_type_kv_cache_manager import (
    FullAttentionManager,
    get_manager_for_kv_cache_spec,
)
from core_engine.core.request import Request


class KVCacheCoordinator:
    """Runs each per-request operation on every group's manager; block lists are tuples
    indexed by group id. Every group takes its blocks from the same pool, so callers count
    the blocks of all groups against the free queue before allocating any."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, num_gpu_blocks: int, enable_caching: bool
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(spec, self.block_pool, group_id)
            for group_id, spec in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[list[KVCacheBlock], ...],
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
            for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True)
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...]
    ) -> None:
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens)
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            list(manager.req_to_blocks.get(request_id, ())) for manager in self.single_type_managers
        )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the number of tokens they hold (the same in every group),
        at most `max_cache_hit_length`."""
        raise NotImplementedError

    def check_integrity(self) -> None:
        """Raises BlockPoolIntegrityError unless the pool is sound, every non-null block's
        ref_cnt equals the number of places it holds in the requests' block lists (of all
        groups), and a hashed block is held only by the group it was hashed for."""
        self.block_pool.check_integrity()
        num_holders: Counter[int] = Counter()
        for manager in self.single_type_managers:
            for request_id, blocks in manager.req_to_blocks.items():
                for block in blocks:
                    if block.is_null:
                        continue
                    num_holders[block.block_id] += 1
                    block_hash = block.block_hash
                    if (
                        block_hash is not None
                        and get_group_id(block_hash) != manager.kv_cache_group_id
                    ):
                        raise BlockPoolIntegrityError(
                            f"request {request_id} holds block {block.block_id} in group "
                            f"{manager.kv_cache_group_id}, but the block is cached for another"
                        )
        for block in self.block_pool.blocks:
            if not block.is_null and block.ref_cnt != num_holders[block.block_id]:
                raise BlockPoolIntegrityError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{num_holders[block.block_id]} holders"
                )


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: the group's own hit is the hit."""

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length
        )
        return (hit_blocks,), len(hit_blocks) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups (full attention and sliding windows): a hit counts only at a length
    where every group has the KV it needs."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, num_gpu_blocks: int, enable_caching: bool
    ) -> None:
        super().__init__(kv_cache_config, num_gpu_blocks, enable_caching)
        # Full attention first: its hit is a plain prefix, a cheap upper bound for the others.
        self.lookup_order = sorted(
            self.single_type_managers,
            key=lambda manager: not isinstance(manager, FullAttentionManager),
        )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Each group looks for a hit within the length the groups before it agreed on; a
        group that finds less shrinks the length, and the lookups repeat until one round
        leaves it unchanged, so every group's hit blocks hold exactly the same tokens."""
        hit_length = max_cache_hit_length // self.block_size * self.block_size
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        while True:
            round_start_length = hit_length
            for manager in self.lookup_order:
                blocks = manager.find_longest_cache_hit(block_hashes, hit_length)
                hit_blocks[manager.kv_cache_group_id] = blocks
                hit_length = len(blocks) * self.block_size
            if hit_length == round_start_length:
                return tuple(hit_blocks), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, num_gpu_blocks: int, enable_caching: bool
) -> KVCacheCoordinator:
    if kv_cache_config.num_groups == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, num_gpu_blocks, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, num_gpu_blocks, enable_caching)
