"""Hybrid KV cache: sliding-window and full-attention groups under one coordinator and pool."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_engine.common.math_utils import cdiv
from core_engine.core.kv_cache.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from tests.helpers.core_factories import make_request, make_scheduler, run_step

BLOCK = 4


def make_manager(*specs, num_gpu_blocks=32, max_model_len=64, enable_caching=True):
    config = KVCacheConfig(tuple(specs), max_model_len)
    return KVCacheManager(num_gpu_blocks, BLOCK, max_model_len, enable_caching, config)


def make_window_manager(sliding_window=8, **kwargs):
    return make_manager(SlidingWindowSpec(BLOCK, sliding_window), **kwargs)


def make_hybrid_manager(sliding_window=8, **kwargs):
    return make_manager(
        FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, sliding_window), **kwargs
    )


def free_ids(manager):
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def decode(manager, request, token_id=7):
    """One decode step: the last token is computed, a sampled one arrives and gets a slot."""
    request.num_computed_tokens = request.num_tokens
    request.append_output_token_ids(token_id)
    return manager.allocate_slots(request, 1)


def compute_in_chunks(manager, request, chunk):
    """Prefills a whole prompt `chunk` tokens per step, as the scheduler would."""
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new


# ---- sliding window: freeing and null blocks ------------------------------------------------


def test_coordinator_kind_follows_the_number_of_groups():
    assert isinstance(make_window_manager().coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(make_hybrid_manager().coordinator, HybridKVCacheCoordinator)
    assert isinstance(KVCacheManager(8, BLOCK, 16).coordinator, UnitaryKVCacheCoordinator)


def test_decoding_frees_blocks_that_leave_the_window_and_puts_null_blocks_in_their_place():
    """Window 8, blocks of 4: the token at position p reads positions p-7..p, so with n tokens
    computed the first (n - 7) // 4 blocks are dead."""
    manager = make_window_manager(sliding_window=8, num_gpu_blocks=16)
    request = make_request("a", list(range(10)), block_size=BLOCK)
    assert manager.allocate_slots(request, 10).get_block_ids() == ([1, 2, 3],)
    expected = [
        # (num_computed_tokens at the allocation, new block ids, block ids held)
        (10, [], [1, 2, 3]),
        (11, [], [0, 2, 3]),  # position 11 reads 4..11: block 1 (positions 0..3) is dead
        (12, [4], [0, 2, 3, 4]),
        (13, [], [0, 2, 3, 4]),
        (14, [], [0, 2, 3, 4]),
        (15, [], [0, 0, 3, 4]),  # position 15 reads 8..15
        (16, [5], [0, 0, 3, 4, 5]),
    ]
    for num_computed, new_ids, held_ids in expected:
        new = decode(manager, request)
        assert request.num_computed_tokens == num_computed
        assert new.get_block_ids() == (new_ids,)
        assert manager.get_block_ids("a") == (held_ids,)
        manager.check_integrity()
    # Freed blocks went to the free queue's tail and keep their hashes for later hits.
    assert free_ids(manager)[-2:] == [1, 2]
    assert all(manager.block_pool.blocks[i].block_hash is not None for i in (1, 2))
    assert manager.block_pool.null_block.ref_cnt == 0
    manager.free(request)
    assert manager.usage == 0.0
    manager.check_integrity()


def test_blocks_that_leave_the_window_pay_for_the_next_block():
    """A full pool: the two blocks a decode step pushes out of the window make room for the
    new blocks of both groups."""
    manager = make_hybrid_manager(sliding_window=4, num_gpu_blocks=7)
    request = make_request("a", list(range(12)), block_size=BLOCK)
    assert manager.allocate_slots(request, 12).get_block_ids() == ([1, 2, 3], [4, 5, 6])
    assert manager.block_pool.get_num_free_blocks() == 0
    assert decode(manager, request).get_block_ids() == ([5], [4])
    assert manager.get_block_ids("a") == ([1, 2, 3, 5], [0, 0, 6, 4])
    manager.check_integrity()


def test_a_chunked_prefill_holds_only_the_window_between_chunks():
    manager = make_window_manager(sliding_window=8, num_gpu_blocks=16)
    request = make_request("a", list(range(24)), block_size=BLOCK)
    compute_in_chunks(manager, request, chunk=8)
    # chunks at 0, 8, 16 computed tokens: blocks 1 and 2 left the window at 16 (reads 9..)
    assert manager.get_block_ids("a") == ([0, 0, 3, 4, 5, 6],)
    assert free_ids(manager)[-2:] == [2, 1]  # freed tail first
    manager.check_integrity()


# ---- prefix hits ----------------------------------------------------------------------------


def test_window_hit_needs_only_a_window_of_cached_blocks_before_the_match_point():
    """Window 8, blocks of 4: ceil(7 / 4) = 2 cached blocks before the match point suffice,
    even after the prompt's first blocks were evicted."""
    manager = make_window_manager(sliding_window=8, num_gpu_blocks=9)
    prompt = list(range(21))
    first = make_request("first", prompt, block_size=BLOCK)
    compute_in_chunks(manager, first, chunk=8)
    assert manager.get_block_ids("first") == ([0, 0, 3, 4, 5, 6],)
    manager.free(first)
    assert free_ids(manager) == [7, 8, 2, 1, 6, 5, 4, 3]
    # A stranger takes 4 blocks from the head: blocks 2 and 1 (the prompt's start) are evicted.
    stranger = make_request("stranger", list(range(100, 116)), block_size=BLOCK)
    assert manager.allocate_slots(stranger, 16).get_block_ids() == ([7, 8, 2, 1],)

    second = make_request("second", prompt, block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 20
    assert blocks.get_block_ids() == ([0, 0, 0, 4, 5],)
    new = manager.allocate_slots(second, 1, num_hit, blocks)
    assert new.get_block_ids() == ([6],)
    assert manager.get_block_ids("second") == ([0, 0, 0, 4, 5, 6],)
    manager.check_integrity()


def test_window_hit_without_a_full_run_is_the_cached_prefix():
    manager = make_window_manager(sliding_window=12, num_gpu_blocks=16)  # run of 3 blocks
    first = make_request("first", list(range(8)), block_size=BLOCK)
    compute_in_chunks(manager, first, chunk=8)
    second = make_request("second", list(range(8)) + [50] * 9, block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2],), 8)


def test_hybrid_hit_is_bounded_by_full_attention_and_agrees_across_groups():
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=32)
    prompt = list(range(24))
    first = make_request("first", prompt, block_size=BLOCK)
    compute_in_chunks(manager, first, chunk=8)
    assert manager.get_block_ids("first") == ([1, 2, 5, 6, 9, 10], [0, 0, 7, 8, 11, 12])
    # The same tokens hash to different blocks in each group.
    second = make_request("second", prompt + [99], block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 24
    assert blocks.get_block_ids() == ([1, 2, 5, 6, 9, 10], [0, 0, 0, 0, 11, 12])
    # Full attention misses from block 3 on: the window group is looked up within 12 tokens.
    third = make_request("third", prompt[:12] + [99] * 9, block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(third)
    assert num_hit == 12
    assert blocks.get_block_ids() == ([1, 2, 5], [0, 4, 7])


def test_hybrid_hit_shrinks_until_both_groups_agree():
    """Full attention hits 3 blocks; the window group lost block 4 (its KV of tokens 4..7),
    so it has no 2-block run ending at 12 tokens, only the prefix [3]: both agree on 4."""
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=16)
    prompt = list(range(24))
    first = make_request("first", prompt, block_size=BLOCK)
    compute_in_chunks(manager, first, chunk=8)
    assert free_ids(manager) == [13, 14, 15, 4, 3]
    stranger = make_request("stranger", list(range(100, 108)), block_size=BLOCK)
    assert manager.allocate_slots(stranger, 8).get_block_ids() == ([13, 14], [15, 4])

    third = make_request("third", prompt[:12] + [99] * 3, block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(third)
    assert num_hit == 4
    assert blocks.get_block_ids() == ([1], [3])
    manager.check_integrity()


# ---- allocation across groups ---------------------------------------------------------------


def test_allocate_counts_every_group_and_refuses_without_side_effects():
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=7)  # 6 usable
    prompt = list(range(8))
    first = make_request("first", prompt, block_size=BLOCK)
    assert manager.allocate_slots(first, 8).get_block_ids() == ([1, 2], [3, 4])
    manager.free(first)
    assert free_ids(manager) == [5, 6, 2, 1, 4, 3]

    second = make_request("second", prompt + list(range(50, 58)), block_size=BLOCK)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2], [3, 4]), 8)
    # 16 tokens: 2 new blocks per group + 4 free hit blocks touched = 8 > 6 free
    assert manager.allocate_slots(second, 8, num_hit, blocks) is None
    assert free_ids(manager) == [5, 6, 2, 1, 4, 3]
    assert all(manager.block_pool.blocks[i].ref_cnt == 0 for i in range(1, 7))
    assert manager.get_block_ids("second") == ([], [])
    assert all("second" not in m.req_to_blocks for m in manager.coordinator.single_type_managers)
    # 12 tokens: 1 new block per group + 4 touched = 6: fits exactly
    new = manager.allocate_slots(second, 4, num_hit, blocks)
    assert new.get_block_ids() == ([5], [6])
    assert manager.get_block_ids("second") == ([1, 2, 5], [3, 4, 6])
    assert manager.block_pool.get_num_free_blocks() == 0
    manager.check_integrity()


def test_allocate_refuses_when_only_the_window_group_is_short():
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=6)  # 5 usable
    request = make_request("a", list(range(12)), block_size=BLOCK)
    assert manager.allocate_slots(request, 12) is None  # 3 + 3 > 5
    assert manager.block_pool.get_num_free_blocks() == 5
    assert manager.get_block_ids("a") == ([], [])
    manager.check_integrity()


def test_free_returns_every_groups_blocks_tail_first():
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=10)
    request = make_request("a", list(range(12)), block_size=BLOCK)
    assert manager.allocate_slots(request, 12).get_block_ids() == ([1, 2, 3], [4, 5, 6])
    request.num_computed_tokens = 12
    manager.free(request)
    assert free_ids(manager) == [7, 8, 9, 3, 2, 1, 6, 5, 4]
    assert manager.usage == 0.0
    assert manager.get_block_ids("a") == ([], [])
    manager.check_integrity()


def test_usage_counts_every_group():
    manager = make_hybrid_manager(sliding_window=8, num_gpu_blocks=9)  # 8 usable
    manager.allocate_slots(make_request("a", list(range(8)), block_size=BLOCK), 8)
    assert manager.usage == 0.5


def test_a_hybrid_scheduler_sends_every_groups_ids_and_frees_the_window_as_it_decodes():
    """Window 4: with n tokens computed, the first (n - 3) // 4 blocks are dead."""
    config = KVCacheConfig((FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, 4)), 64)
    scheduler = make_scheduler(kv_cache_config=config, max_model_len=64)
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=6, block_size=BLOCK))
    output, _ = run_step(scheduler)
    assert output.scheduled_new_reqs[0].block_ids == [[1, 2], [3, 4]]
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([1, 2], [3, 4])
    expected = [
        # (num_computed_tokens, new block ids on the wire (per group), block ids held); the
        # window's freed blocks are not sent: the workers never read them again.
        (8, [[5], [6]], ([1, 2, 5], [0, 4, 6])),
        (9, [], ([1, 2, 5], [0, 4, 6])),
        (10, [], ([1, 2, 5], [0, 4, 6])),
        (11, [], ([1, 2, 5], [0, 0, 6])),
    ]
    for num_computed, new_block_ids, held_block_ids in expected:
        output, _ = run_step(scheduler)
        cached = output.scheduled_cached_reqs[0]
        assert (cached.num_computed_tokens, cached.new_block_ids) == (num_computed, new_block_ids)
        assert scheduler.kv_cache_manager.get_block_ids("a") == held_block_ids
        scheduler.kv_cache_manager.check_integrity()
    output, outputs = run_step(scheduler)  # the sixth token: max_tokens reached, all freed
    assert output.scheduled_cached_reqs[0].new_block_ids == [[7], [8]]
    assert outputs.outputs[0].finish_reason is not None
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([], [])
    assert scheduler.kv_cache_manager.usage == 0.0
    scheduler.kv_cache_manager.check_integrity()


# ---- configs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SlidingWindowSpec(BLOCK, 0), "sliding_window must be at least 1, got 0"),
        (lambda: FullAttentionSpec(0), "block_size must be at least 1, got 0"),
        (lambda: KVCacheConfig((), 64), "at least one group"),
        (
            lambda: KVCacheConfig((FullAttentionSpec(4), SlidingWindowSpec(4, 65)), 64),
            "KV cache group 1 has sliding_window=65, larger than max_model_len=64",
        ),
        (
            lambda: KVCacheConfig((FullAttentionSpec(4), SlidingWindowSpec(8, 16)), 64),
            "KV cache group 1 has block_size=8 but group 0 has block_size=4: all groups must "
            "share one block size",
        ),
        (
            lambda: KVCacheConfig((FullAttentionSpec(4), SlidingWindowSpec(6, 16)), 64),
            "KV cache group 1 has block_size=6, which does not divide and is not a multiple "
            "of group 0's block_size=4",
        ),
        (
            lambda: KVCacheManager(
                32, 8, 64, kv_cache_config=KVCacheConfig((FullAttentionSpec(4),), 64)
            ),
            "the KV cache config has block_size=4 and max_model_len=64, but the engine has "
            "block_size=8 and max_model_len=64",
        ),
        (
            lambda: Scheduler(
                SchedulerConfig(max_model_len=64, block_size=4, num_gpu_blocks=20),
                KVCacheConfig((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), 64),
            ),
            "num_gpu_blocks=20 cannot hold one request of max_model_len=64 tokens in its "
            "2 KV cache groups (32 blocks of 4 plus the null block)",
        ),
    ],
)
def test_bad_configs_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_a_sliding_window_group_needs_only_its_window_and_one_step_of_blocks():
    groups = KVCacheConfig((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), 64)
    # Full attention: 16 blocks; the window: cdiv(8 - 1 + 8, 4) + 1 = 5 blocks; plus the null.
    config = SchedulerConfig(
        max_model_len=64, block_size=4, num_gpu_blocks=22, max_num_batched_tokens=8
    )
    Scheduler(config, groups)
    with pytest.raises(ValueError, match=r"\(21 blocks of 4 plus the null block\)"):
        Scheduler(dataclasses.replace(config, num_gpu_blocks=21), groups)


# ---- random operations ----------------------------------------------------------------------

advance = st.tuples(st.just("advance"), st.integers(0, 100), st.integers(1, 12), st.integers(0, 1))
operations = st.lists(
    st.one_of(
        # a prompt: some of the shared prefix, then a few tokens of its own (prefix hits)
        st.tuples(
            st.just("add"),
            st.integers(0, 24),
            st.lists(st.integers(0, 1), min_size=1, max_size=6),
            st.integers(1, 24),
        ),
        advance,
        advance,
        advance,
        st.tuples(st.just("free"), st.integers(0, 100)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=operations,
    shared_prefix=st.lists(st.integers(0, 1), min_size=24, max_size=24),
    sliding_window=st.integers(1, 13),
    num_gpu_blocks=st.integers(4, 40),
    enable_caching=st.booleans(),
)
def test_random_operations_keep_every_group_sound(
    operations, shared_prefix, sliding_window, num_gpu_blocks, enable_caching
):
    max_model_len = 32
    manager = make_hybrid_manager(
        sliding_window=sliding_window,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
    )
    live = {}  # request id -> (request, num_computed_tokens when its window was last slid)
    for index, operation in enumerate(operations):
        if operation[0] == "add":
            _, num_shared, own_tokens, chunk = operation
            prompt = shared_prefix[:num_shared] + own_tokens
            request = make_request(f"r{index}", prompt, block_size=BLOCK)
            blocks, num_hit = manager.get_computed_blocks(request)
            assert num_hit % BLOCK == 0 and num_hit < request.num_tokens
            assert [len(group) for group in blocks.blocks] == [num_hit // BLOCK] * 2
            num_new = min(chunk, request.num_tokens - num_hit)
            if manager.allocate_slots(request, num_new, num_hit, blocks) is None:
                assert manager.get_block_ids(request.request_id) == ([], [])
            else:
                request.num_computed_tokens = num_hit + num_new
                live[request.request_id] = (request, num_hit)
        elif operation[0] == "advance" and live:
            _, pick, chunk, token_id = operation
            request, _ = live[sorted(live)[pick % len(live)]]
            if request.num_computed_tokens == request.num_tokens:
                if request.num_tokens == max_model_len:
                    manager.free(request)
                    del live[request.request_id]
                    continue
                request.append_output_token_ids(token_id)
            num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
            num_computed = request.num_computed_tokens
            if manager.allocate_slots(request, num_new) is None:
                manager.free(request)  # preempted
                del live[request.request_id]
            else:
                request.num_computed_tokens += num_new
                live[request.request_id] = (request, num_computed)
        elif operation[0] == "free" and live:
            request, _ = live.pop(sorted(live)[operation[1] % len(live)])
            manager.free(request)
        _check_hybrid_invariants(manager, live, sliding_window)

    for request, _ in live.values():
        manager.free(request)
    _check_hybrid_invariants(manager, {}, sliding_window)
    assert manager.usage == 0.0


def _check_hybrid_invariants(manager, live, sliding_window):
    manager.check_integrity()
    pool = manager.block_pool
    num_holders = [0] * pool.num_gpu_blocks
    for request, window_from in live.values():
        full_ids, window_ids = manager.get_block_ids(request.request_id)
        num_needed_blocks = cdiv(request.num_computed_tokens, BLOCK)
        assert len(full_ids) >= num_needed_blocks and len(window_ids) >= num_needed_blocks
        assert 0 not in full_ids
        num_skipped = max(window_from - sliding_window + 1, 0) // BLOCK
        # Blocks before the window are null; every block in the window is a real block.
        assert window_ids[:num_skipped] == [0] * num_skipped
        assert 0 not in window_ids[num_skipped:]
        for block_id in full_ids + window_ids[num_skipped:]:
            num_holders[block_id] += 1
    free_ids_set = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == num_holders[block.block_id]
        assert (block.block_id in free_ids_set) == (block.ref_cnt == 0)
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids_set
