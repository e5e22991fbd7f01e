"""The scheduler's interface to KV memory: prefix-cache lookup, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.core.kv_cache.kv_cache_coordinator import get_kv_cache_coordinator
from core_engine.core.kv_cache.kv_cache_events import KVCacheEventLog
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_cache.kv_cache_utils import KVCacheBlock
from core_engine.core.request import Request


@dataclass(slots=True)
class KVCacheBlocks:
    """The blocks an allocation or a prefix hit produced, per KV cache group (`blocks[g]`
    for group g), in order. A null block stands for a block outside a sliding window."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups: `requests` looked up, their tokens (`queries`) and the
    tokens the cache held (`hits`). One lookup counts per admission from the waiting queue,
    when the request is admitted (vLLM's semantics: a request that waits several steps for
    blocks is looked up each step but counted once). The lookups of requests readmitted after
    a preemption (they find their own blocks again) go to the `preempted_*` counters, so they
    do not inflate the hit rate."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Counts one admitted request's lookup of `num_tokens` tokens that hit `num_hits`."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """Allocates KV slots to requests from one `BlockPool`, reusing cached prefixes.

    One full-attention group unless `kv_cache_config` gives the groups of a hybrid model
    (its block size and max_model_len must be the ones given here).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if kv_cache_config is None:
            kv_cache_config = KVCacheConfig.full_attention(block_size, max_model_len)
        elif (kv_cache_config.block_size, kv_cache_config.max_model_len) != (
            block_size,
            max_model_len,
        ):
            raise ValueError(
                f"the KV cache config has block_size={kv_cache_config.block_size} and "
                f"max_model_len={kv_cache_config.max_model_len}, but the engine has "
                f"block_size={block_size} and max_model_len={max_model_len}"
            )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.kv_cache_config = kv_cache_config
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, num_gpu_blocks, enable_caching)
        self.block_pool = self.coordinator.block_pool
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_kv_cache_groups(self) -> int:
        return self.kv_cache_config.num_groups

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, all groups together (they share one pool)."""
        return self.block_pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, as (blocks per group, number of tokens they
        hold); every group holds the KV it needs for the same number of tokens.

        A hit covers at most `num_tokens - 1` tokens: the last token is always computed, since
        its logits are needed to sample. The blocks are not yet referenced; pass them to
        `allocate_slots` in the same step. Counts nothing: the scheduler calls
        `record_prefix_cache_stats` once the request is admitted.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        return KVCacheBlocks(computed_blocks), num_computed_tokens

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Counts the lookup of a request just admitted with `num_hits` cached tokens (from
        `get_computed_blocks`): in the `preempted_*` counters if it was ever preempted. Nothing
        is counted while prefix caching is off."""
        if self.enable_caching:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hits, preempted=request.num_preemptions > 0
            )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for `num_new_tokens` more tokens after its computed ones,
        in every group.

        `new_computed_blocks` (from `get_computed_blocks`) are prefix hits, holding
        `num_new_computed_tokens` tokens, that become the request's first blocks. Blocks that
        fell out of a sliding window are freed first (no later token reads them). Returns the
        newly allocated blocks per group, or None when the free queue cannot hold the new
        blocks of every group, counting hit blocks that sit in the free queue as used (the
        caller then preempts someone); on None no group allocates or touches a block (the
        blocks outside the window stay freed: they are dead either way). Full blocks are
        registered in the prefix cache as soon as their tokens are scheduled.

        `num_external_computed_tokens` follow the hit: a KV connector fills their (new) blocks,
        so `num_new_tokens` may be 0 when the request only waits for them. With
        `delay_cache_blocks` no block is cached now (the connector has not filled them yet);
        `cache_blocks` does it once they are.
        """
        if num_new_tokens < 0 or num_new_tokens + num_external_computed_tokens <= 0:
            raise ValueError(
                f"num_new_tokens must be positive, got {num_new_tokens} (0 only with "
                f"num_external_computed_tokens, got {num_external_computed_tokens})"
            )
        if new_computed_blocks is None:
            new_computed_blocks = self.empty_blocks()
        new_computed_block_lists = new_computed_blocks.blocks
        if not self.enable_caching and any(new_computed_block_lists):
            raise ValueError("prefix-hit blocks given while prefix caching is disabled")
        num_computed_tokens = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        self.coordinator.remove_skipped_blocks(request.request_id, num_computed_tokens)
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed_block_lists
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        self.coordinator.save_new_computed_blocks(request.request_id, new_computed_block_lists)
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full blocks up to `num_computed_tokens` in the prefix cache
        (blocks allocated with `delay_cache_blocks`, once a connector has filled them)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Frees the request's blocks in every group."""
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def enable_kv_cache_events(self) -> KVCacheEventLog:
        """Turns on the pool's log of blocks cached and evicted (see `BlockPool`)."""
        return self.block_pool.enable_kv_cache_events()

    def check_integrity(self) -> None:
        """Raises BlockPoolIntegrityError if the pool or any group's bookkeeping is unsound."""
        self.coordinator.check_integrity()
