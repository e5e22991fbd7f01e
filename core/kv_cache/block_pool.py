"""The pool of physical KV blocks: allocation, freeing, prefix-cache lookup and LRU eviction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from core_engine.core.kv_cache.kv_cache_events import LOGGED_GROUP_ID, KVCacheEventLog
from core_engine.core.kv_cache.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_group_id,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from core_engine.core.request import Request


class BlockPoolIntegrityError(RuntimeError):
    """An invariant of the block pool does not hold: a bug, never a user error."""


class BlockHashToBlockMap:
    """Block hash (with group id) -> cached blocks. One hash may map to several blocks (two
    requests that computed the same content at the same time each hold their own copy)."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def contains(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> bool:
        return self._cache.get(key, {}).get(block.block_id) is block

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, dict[int, KVCacheBlock]]]:
        return self._cache.items()

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """Owns every `KVCacheBlock` of one KV cache, shared by all KV cache groups.

    Block 0 is the null block: a placeholder (e.g. for blocks that fell out of a sliding
    window) that is never handed out, freed, hashed or reference-counted.
    A freed block keeps its hash (its KV stays valid) until it is reused, so a later request
    can hit it; reuse evicts the stale hash first. Hashes are keyed per KV cache group.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be at least 2 (one is the null block), got {num_gpu_blocks}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Set by `enable_kv_cache_events` (data parallelism): what the cache gains and loses.
        self.kv_event_log: KVCacheEventLog | None = None

    def enable_kv_cache_events(self) -> KVCacheEventLog:
        """Starts logging the first group's stored and removed hashes; returns the log."""
        self.kv_event_log = KVCacheEventLog()
        return self.kv_event_log

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_id: int = 0
    ) -> KVCacheBlock | None:
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        return self.cached_block_hash_to_block.get_one_block(key)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Registers `blocks[num_cached_blocks:num_full_blocks]` under the request's hashes
        for group `kv_cache_group_id` (null blocks are skipped).

        The request's `block_hashes` must already cover `num_full_blocks` blocks.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise BlockPoolIntegrityError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
                f"needs {num_full_blocks} (block_size {block_size})"
            )
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null or block.block_hash is not None:
                continue
            key = make_block_hash_with_group_id(request.block_hashes[index], kv_cache_group_id)
            block.block_hash = key
            if self.kv_event_log is not None:
                self._log_stored(key)
            self.cached_block_hash_to_block.insert(key, block)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the head of the free queue with ref_cnt 1 each.

        Raises ValueError when fewer are free. A reused block loses its stale hash.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.reset_hash()
        if self.kv_event_log is not None:
            self._log_removed(block_hash)
        return True

    def _log_stored(self, key: BlockHashWithGroupId) -> None:
        """Logs `key` before it enters the map, unless a copy is already there."""
        is_new = self.cached_block_hash_to_block.get_one_block(key) is None
        if is_new and get_group_id(key) == LOGGED_GROUP_ID:
            self.kv_event_log.record_stored(key)

    def _log_removed(self, key: BlockHashWithGroupId) -> None:
        """Logs `key` after a block left the map, once no copy is left."""
        is_gone = self.cached_block_hash_to_block.get_one_block(key) is None
        if is_gone and get_group_id(key) == LOGGED_GROUP_ID:
            self.kv_event_log.record_removed(key)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the free queue's tail
        in the given order (callers pass a request's blocks tail first, so a request's last
        blocks are evicted before its shared prefix)."""
        newly_free = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                newly_free.append(block)
        self.free_block_queue.append_n(newly_free)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        num_usable = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / num_usable

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Only possible when no request holds a block."""
        num_used_blocks = self.num_gpu_blocks - 1 - self.get_num_free_blocks()
        if num_used_blocks > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.kv_event_log is not None:
            self.kv_event_log.record_cleared()
        return True

    def check_integrity(self) -> None:
        """Raises BlockPoolIntegrityError if any invariant of the pool is broken."""
        free_blocks = self.free_block_queue.get_all_free_blocks()
        free_ids = {block.block_id for block in free_blocks}
        _require(len(free_ids) == len(free_blocks), "a block appears twice in the free queue")
        _require(
            len(free_blocks) == self.free_block_queue.num_free_blocks,
            f"free queue holds {len(free_blocks)} blocks but counts "
            f"{self.free_block_queue.num_free_blocks}",
        )
        _require(self.null_block.block_id not in free_ids, "the null block is in the free queue")
        _require(
            self.null_block.ref_cnt == 0 and self.null_block.block_hash is None,
            f"the null block is counted or hashed: {self.null_block!r}",
        )
        for block in self.blocks:
            if block.is_null:
                continue
            _require(block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            _require(
                (block.ref_cnt == 0) == (block.block_id in free_ids),
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with free queue membership",
            )
            if block.block_hash is not None:
                _require(
                    self.cached_block_hash_to_block.contains(block.block_hash, block),
                    f"hashed block {block.block_id} missing from the hash map",
                )
        for block_hash, blocks in self.cached_block_hash_to_block.items():
            for block_id, block in blocks.items():
                _require(
                    block.block_id == block_id and block.block_hash == block_hash,
                    f"hash map entry for block {block_id} does not match the block",
                )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BlockPoolIntegrityError(message)
