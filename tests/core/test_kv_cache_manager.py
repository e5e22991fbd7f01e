"""KVCacheManager: prefix hits, slot allocation and freeing, with exact block ids."""

from __future__ import annotations

import pytest

from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.core.kv_cache.kv_cache_utils import make_block_hash_with_group_id
from tests.helpers.core_factories import make_request

BLOCK = 16


def make_manager(num_gpu_blocks=32, block_size=BLOCK, max_model_len=512, enable_caching=True):
    return KVCacheManager(num_gpu_blocks, block_size, max_model_len, enable_caching)


def compute_fully(manager, request):
    """Allocates and 'computes' a whole prompt, as the scheduler would."""
    blocks, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    request.num_computed_tokens = request.num_tokens
    return blocks, num_hit, new


def test_allocate_fresh_prompt_takes_blocks_from_the_head():
    manager = make_manager()
    request = make_request("a", list(range(40)), block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 0 and blocks.get_block_ids() == ([],)
    new = manager.allocate_slots(request, 40)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    # the two full blocks are registered in the prefix cache, the partial one is not
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, True, False]
    manager.block_pool.check_integrity()


def test_ten_cached_blocks_plus_three_new_tokens_need_exactly_one_block():
    """Seed example: a 10-block prefix hit, 3 more tokens -> 11 blocks, 1 of them new."""
    manager = make_manager()
    prefix = list(range(1000, 1160))
    first = make_request("first", prefix + [1], block_size=BLOCK)
    compute_fully(manager, first)
    manager.free(first)
    second = make_request("second", prefix + [7, 8, 9], block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 160 and len(blocks.blocks[0]) == 10
    num_free_before = manager.block_pool.get_num_free_blocks()
    new = manager.allocate_slots(second, 3, num_hit, blocks)
    assert len(new.blocks[0]) == 1
    assert manager.get_block_ids("second")[0][:10] == blocks.get_block_ids()[0]
    assert len(manager.get_block_ids("second")[0]) == 11
    assert manager.block_pool.get_num_free_blocks() == num_free_before - 11
    manager.block_pool.check_integrity()


def test_hit_never_covers_the_last_token():
    manager = make_manager()
    prompt = list(range(32))  # exactly 2 full blocks
    compute_fully(manager, make_request("a", prompt, block_size=BLOCK))
    blocks, num_hit = manager.get_computed_blocks(make_request("b", prompt, block_size=BLOCK))
    assert num_hit == 16 and len(blocks.blocks[0]) == 1


def test_hit_stops_at_the_first_miss():
    manager = make_manager()
    prompt = list(range(64))
    compute_fully(manager, make_request("a", prompt, block_size=BLOCK))
    changed = prompt[:16] + [999] + prompt[17:] + [5]
    _, num_hit = manager.get_computed_blocks(make_request("b", changed, block_size=BLOCK))
    assert num_hit == 16


def test_allocate_returns_none_counting_free_hit_blocks_as_used():
    manager = make_manager(num_gpu_blocks=5)  # 4 usable
    prompt = list(range(32))
    first = make_request("a", prompt, block_size=BLOCK)
    compute_fully(manager, first)
    manager.free(first)  # blocks 1, 2 cached and free
    second = make_request("b", prompt + list(range(100, 140)), block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 32
    # needs 5 blocks total: 2 hits (free, so they count) + 3 new > 4 free
    assert manager.allocate_slots(second, 40, num_hit, blocks) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    assert manager.allocate_slots(second, 32, num_hit, blocks) is not None
    manager.block_pool.check_integrity()


def test_free_releases_blocks_tail_first_and_keeps_hashes():
    manager = make_manager(num_gpu_blocks=6)
    request = make_request("a", list(range(48)), block_size=BLOCK)
    compute_fully(manager, request)
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    manager.free(request)
    order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [4, 5, 3, 2, 1]
    assert all(manager.block_pool.blocks[i].block_hash is not None for i in (1, 2))
    assert manager.usage == 0.0


def test_decode_appends_blocks_as_tokens_arrive():
    manager = make_manager()
    request = make_request("a", list(range(15)), block_size=BLOCK)
    compute_fully(manager, request)
    assert manager.get_block_ids("a") == ([1],)
    request.append_output_token_ids(42)  # 16 tokens: block 1 is now full
    new = manager.allocate_slots(request, 1)
    assert new.get_block_ids() == ([],)
    assert manager.block_pool.blocks[1].block_hash == make_block_hash_with_group_id(
        request.block_hashes[0], 0
    )
    request.num_computed_tokens = 16
    request.append_output_token_ids(43)
    assert manager.allocate_slots(request, 1).get_block_ids() == ([2],)


def test_prefix_cache_stats_count_recorded_admissions_in_tokens():
    """A lookup counts nothing by itself; each recorded admission counts once, in the
    preempted_* counters for a request that was preempted before."""
    manager = make_manager()
    prompt = list(range(40))
    first = make_request("a", prompt, block_size=BLOCK)
    manager.record_prefix_cache_stats(first, compute_fully(manager, first)[1])
    waiting = make_request("b", prompt, block_size=BLOCK)
    for _ in range(3):  # looked up each step it waits
        _, num_hit = manager.get_computed_blocks(waiting)
    manager.record_prefix_cache_stats(waiting, num_hit)
    resumed = make_request("c", prompt, block_size=BLOCK)
    resumed.num_preemptions = 1
    manager.record_prefix_cache_stats(resumed, manager.get_computed_blocks(resumed)[1])
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 40, 32)


def test_caching_disabled_never_hits():
    manager = make_manager(enable_caching=False)
    prompt = list(range(40))
    compute_fully(manager, make_request("a", prompt, block_size=BLOCK))
    second = make_request("b", prompt, block_size=BLOCK)
    _, num_hit = manager.get_computed_blocks(second)
    manager.record_prefix_cache_stats(second, num_hit)
    assert num_hit == 0
    assert len(manager.block_pool.cached_block_hash_to_block) == 0
    assert manager.prefix_cache_stats.requests == 0  # no lookup, nothing counted


def test_a_cache_salt_separates_prefix_cache_entries():
    """Same prompt: hits within one salt, none across two salts or salted and unsalted."""
    manager = make_manager()
    prompt = list(range(40))  # 2 full blocks

    def salted_request(salt):
        return make_request(str(salt), prompt, block_size=BLOCK, cache_salt=salt)

    for salt in (None, "tenant-a", "tenant-b"):
        _, num_hit, _ = compute_fully(manager, salted_request(salt))
        assert num_hit == 0, salt
    for salt in (None, "tenant-a", "tenant-b"):
        _, num_hit = manager.get_computed_blocks(salted_request(salt))
        assert num_hit == 32, salt
    unsalted, salted = salted_request(None), salted_request("tenant-a")
    assert salted.block_hashes[0] != unsalted.block_hashes[0]
    assert salted.block_hashes[1] != unsalted.block_hashes[1]  # chained from the first


def test_allocation_is_capped_at_max_model_len():
    manager = make_manager(max_model_len=40)
    request = make_request("a", list(range(40)), block_size=BLOCK)
    new = manager.allocate_slots(request, 40, num_lookahead_tokens=20)
    assert len(new.blocks[0]) == 3


def test_zero_new_tokens_is_an_error():
    manager = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens must be positive, got 0"):
        manager.allocate_slots(make_request("a", [1]), 0)
