"""BlockPool and FreeKVCacheBlockQueue: exact block ids, eviction order, hashing."""

from __future__ import annotations

import pytest

from core_engine.common.block_hash import hash_block_tokens
from core_engine.core.kv_cache.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    BlockPoolIntegrityError,
)
from core_engine.core.kv_cache.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from tests.helpers.core_factories import make_request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_links_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4]
    queue.append(blocks[2])
    queue.append_n([blocks[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 3]
    assert queue.num_free_blocks == 3
    with pytest.raises(ValueError, match="asked for 4 free blocks, only 3"):
        queue.popleft_n(4)


def test_null_block_is_block_zero_and_never_handed_out():
    pool = BlockPool(num_gpu_blocks=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: only 0 are free"):
        pool.get_new_blocks(1)
    pool.check_integrity()


def test_free_in_reverse_order_evicts_tail_blocks_first():
    """Seed example: a request's blocks are freed tail first, so its prefix survives longest."""
    pool = BlockPool(num_gpu_blocks=5)
    blocks = pool.get_new_blocks(4)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 3]
    pool.check_integrity()


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    """Seed example: a cached block with ref_cnt 0 is hit again."""
    pool = BlockPool(num_gpu_blocks=6)
    request = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    hit = pool.get_cached_block(request.block_hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 4, 5, 2]
    pool.touch([hit])  # a second request sharing the block
    assert hit.ref_cnt == 2
    pool.check_integrity()


def test_reusing_a_cached_block_evicts_its_stale_hash():
    pool = BlockPool(num_gpu_blocks=3)
    request = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    reused = pool.get_new_blocks(1)[0]
    assert reused.block_id == 2 and reused.block_hash is None
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.check_integrity()


def test_two_blocks_under_one_hash():
    """Seed example: two running requests computed the same block at once."""
    pool = BlockPool(num_gpu_blocks=4)
    first, second = make_request("a", [5, 6, 7, 8]), make_request("b", [5, 6, 7, 8])
    block_a, block_b = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [block_a], 0, 1, 4)
    pool.cache_full_blocks(second, [block_b], 0, 1, 4)
    assert first.block_hashes[0] == second.block_hashes[0]
    assert block_a.block_hash == block_b.block_hash
    pool.check_integrity()
    pool.free_blocks([block_a])
    assert pool.get_new_blocks(2)[1] is block_a  # head is block 3, then block_a
    assert pool.get_cached_block(first.block_hashes[0]) is block_b
    pool.check_integrity()


def test_hash_map_pop_insert_and_len():
    mapping = BlockHashToBlockMap()
    key = hash_block_tokens(None, [1, 2])
    one, two = KVCacheBlock(1), KVCacheBlock(2)
    mapping.insert(key, one)
    mapping.insert(key, two)
    assert len(mapping) == 1 and mapping.get_one_block(key) is one
    assert mapping.pop(key, 1) is one
    assert mapping.get_one_block(key) is two
    assert mapping.pop(key, 1) is None
    assert mapping.pop(key, 2) is two and len(mapping) == 0


def test_hashes_are_chained_and_depend_on_extra_keys():
    first = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1, 2, 3]) == first
    assert len(first) == 16
    assert hash_block_tokens(first, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != first


def test_usage_and_reset_prefix_cache():
    pool = BlockPool(num_gpu_blocks=5)
    request = make_request("a", list(range(4)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 1, 4)
    assert pool.get_usage() == pytest.approx(0.5)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    pool.check_integrity()


def test_check_integrity_catches_broken_invariants():
    pool = BlockPool(num_gpu_blocks=4)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt = 0  # in use but claims to be free
    with pytest.raises(BlockPoolIntegrityError, match="disagrees with free queue"):
        pool.check_integrity()
    block.ref_cnt = 1
    block.block_hash = hash_block_tokens(None, [1])  # hashed but not in the map
    with pytest.raises(BlockPoolIntegrityError, match="missing from the hash map"):
        pool.check_integrity()


def test_pool_needs_room_beyond_the_null_block():
    with pytest.raises(ValueError, match="num_gpu_blocks must be at least 2"):
        BlockPool(num_gpu_blocks=1)
