"""`build_kv_block_map`: exact per-block states of tiny pools, and the summarised cells."""

from __future__ import annotations

import pytest

from core_engine.core.kv_cache.block_pool import BlockPool
from core_engine.core.kv_cache.kv_block_map import build_kv_block_map
from core_engine.proto import (
    KVBlockMap,
    KVBlockState,
    MessageDecoder,
    MessageEncoder,
    UtilityResponse,
)
from tests.helpers.core_factories import BLOCK_SIZE, make_request, make_scheduler, run_step

F, C, U, S, R = (int(state) for state in KVBlockState)


def pool_in_every_state() -> BlockPool:
    """Blocks 1-2 cached and free, 3 in use by one request, 4 shared by two, 5-7 never used."""
    pool = BlockPool(num_gpu_blocks=8)
    request = make_request("a", list(range(2 * BLOCK_SIZE)))
    cached = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, cached, 0, 2, BLOCK_SIZE)
    in_use, shared = pool.get_new_blocks(2)
    pool.touch([shared])  # a second request holding the same block
    pool.free_blocks(cached)
    assert [b.block_id for b in cached] == [1, 2] and (in_use.block_id, shared.block_id) == (3, 4)
    return pool


def test_each_block_gets_its_state():
    block_map = build_kv_block_map(pool_in_every_state(), max_cells=64)
    assert list(block_map.states) == [R, C, C, U, S, F, F, F]
    assert block_map.blocks_per_cell == 1
    assert block_map.num_blocks == 8
    assert block_map.num_blocks_by_state == [3, 2, 1, 1, 1]


def test_a_reused_cached_block_is_in_use_and_a_freed_one_without_hash_is_free():
    pool = pool_in_every_state()
    pool.get_new_blocks(4)  # blocks 5, 6, 7 then the LRU cached block 1, whose hash goes
    block_map = build_kv_block_map(pool, max_cells=64)
    assert list(block_map.states) == [R, U, C, U, S, U, U, U]


def test_a_large_pool_is_summarised_into_cells_showing_the_busiest_state():
    block_map = build_kv_block_map(pool_in_every_state(), max_cells=3)
    # 8 blocks in cells of 3: [R C C] [U S F] [F F + padding]
    assert block_map.blocks_per_cell == 3
    assert list(block_map.states) == [R, S, F]
    assert block_map.num_blocks_by_state == [3, 2, 1, 1, 1]  # still counted per block


def test_max_cells_must_be_positive():
    with pytest.raises(ValueError, match="max_cells must be at least 1, got 0"):
        build_kv_block_map(BlockPool(num_gpu_blocks=4), max_cells=0)


def test_a_scheduled_request_shows_in_use_and_its_finished_prefix_stays_cached():
    scheduler = make_scheduler(num_gpu_blocks=8, max_model_len=16)
    pool = scheduler.kv_cache_manager.block_pool
    scheduler.add_request(make_request("a", list(range(2 * BLOCK_SIZE)), max_tokens=2))
    run_step(scheduler)
    assert list(build_kv_block_map(pool, max_cells=64).states) == [R, U, U, F, F, F, F, F]
    run_step(scheduler)  # the second token needs a third block; then the request finishes
    assert not scheduler.requests
    assert list(build_kv_block_map(pool, max_cells=64).states) == [R, C, C, F, F, F, F, F]


def test_the_map_crosses_the_wire_in_a_utility_response():
    block_map = build_kv_block_map(pool_in_every_state(), max_cells=64)
    frames = MessageEncoder().encode(UtilityResponse(7, kv_block_map=block_map))
    decoded = MessageDecoder([UtilityResponse]).decode(frames)
    assert decoded.kv_block_map == block_map
    assert isinstance(decoded.kv_block_map, KVBlockMap)
