"""Per-attention-type block bookkeeping behind the KVCacheManager.

Full attention is the only type today; a sliding-window manager would free blocks that fall out
of its window and look up hits from the right, behind this same interface.
"""

from __future__ import annotations

from collections import defaultdict

from common.math_utils import cdiv
from core.block_pool import BlockPool
from core.kv_cache_utils import BlockHash, KVCacheBlock
from core.request import Request


class SingleTypeKVCacheManager:
    """Which blocks each request holds, and how many of them are registered in the cache.

    Invariant: `req_to_blocks[rid][:num_cached_block[rid]]` are hashed blocks of that request.
    """

    def __init__(self, block_size: int, block_pool: BlockPool) -> None:
        self.block_size = block_size
        self.block_pool = block_pool
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Blocks this request would take from the free queue: new ones, plus hit blocks that
        currently sit in the free queue (touching them removes them from it)."""
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_new_blocks = (
            num_required_blocks - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        )
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
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
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
            cached_block = self.block_pool.get_cached_block(block_hash)
            if cached_block is None:
                break
            computed_blocks.append(cached_block)
        return computed_blocks
