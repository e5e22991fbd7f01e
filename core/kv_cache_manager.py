"""The scheduler's interface to KV memory: prefix-cache lookup, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.block_pool import BlockPool
from core.kv_cache_utils import KVCacheBlock
from core.request import Request
from core.single_type_kv_cache_manager import FullAttentionManager


@dataclass(slots=True)
class KVCacheBlocks:
    """The blocks an allocation or a prefix hit produced, in order."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens (queries) and hit tokens (hits)."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Allocates KV slots to requests from one `BlockPool`, reusing cached prefixes."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.single_type_manager = FullAttentionManager(block_size, self.block_pool)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, as (blocks, number of tokens they hold).

        A hit covers at most `num_tokens - 1` tokens: the last token is always computed, since
        its logits are needed to sample. The blocks are not yet referenced; pass them to
        `allocate_slots` in the same step.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = self.single_type_manager.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        num_computed_tokens = len(computed_blocks) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return KVCacheBlocks(computed_blocks), num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` (from `get_computed_blocks`) are prefix hits, holding
        `num_new_computed_tokens` tokens, that become the request's first blocks. Returns the
        newly allocated blocks, or None when the free queue is short, counting hit blocks that
        sit in the free queue as used (the caller then preempts someone). Full blocks are
        registered in the prefix cache as soon as their tokens are scheduled.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        new_computed_block_list = new_computed_blocks.blocks if new_computed_blocks else []
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_blocks_to_allocate = self.single_type_manager.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed_block_list
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        if self.enable_caching:
            self.single_type_manager.save_new_computed_blocks(
                request.request_id, new_computed_block_list
            )
        elif new_computed_block_list:
            raise ValueError("prefix-hit blocks given while prefix caching is disabled")
        new_blocks = self.single_type_manager.allocate_new_blocks(
            request.request_id, num_tokens_need_slot
        )
        if self.enable_caching:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.single_type_manager.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request) -> None:
        self.single_type_manager.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(list(self.single_type_manager.req_to_blocks.get(request_id, [])))

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
