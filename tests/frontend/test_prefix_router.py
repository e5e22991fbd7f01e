"""Prefix-aware routing for data parallelism: the hashes a frontend computes equal the ones its
cores cache, the cores' KV cache events, and the router's choices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core_engine.common.block_hash import (
    NONE_HASH,
    PREFIX_HASH_SEED_ENV,
    compact_block_hash,
    prompt_block_hashes,
    seed_from_env,
)
from core_engine.core.kv_cache.block_pool import BlockPool
from core_engine.core.kv_cache.kv_cache_events import KVCacheEventLog
from core_engine.frontend.prefix_router import CoreCacheMirror, PrefixAwareRouter
from core_engine.proto import KVCacheEvents
from tests.helpers.core_factories import make_request

BLOCK = 4


# ---- hashes ---------------------------------------------------------------------------------


def test_the_frontend_computes_the_hashes_a_core_with_the_same_seed_caches():
    prompt = list(range(1, 15))  # 3 full blocks of 4 and 2 tokens
    request = make_request("a", prompt, block_size=BLOCK)
    assert prompt_block_hashes(prompt, BLOCK, NONE_HASH) == request.block_hashes
    other_seed = prompt_block_hashes(prompt, BLOCK, b"\x01" * 16)
    assert len(other_seed) == 3 and set(other_seed).isdisjoint(request.block_hashes)


def test_the_frontend_computes_the_salted_hashes_a_core_caches_for_a_salted_prompt():
    prompt = list(range(1, 15))
    salted = make_request("a", prompt, block_size=BLOCK, cache_salt="tenant-a")
    assert prompt_block_hashes(prompt, BLOCK, NONE_HASH, "tenant-a") == salted.block_hashes
    router = PrefixAwareRouter(2, BLOCK, NONE_HASH, capacity=100)
    core_hashes = [compact_block_hash(h) for h in salted.block_hashes]
    assert router.block_hashes(prompt, "tenant-a") == core_hashes
    unsalted = prompt_block_hashes(prompt, BLOCK, NONE_HASH)
    other_salt = prompt_block_hashes(prompt, BLOCK, NONE_HASH, "tenant-b")
    assert set(salted.block_hashes).isdisjoint(unsalted)  # every block, not just the first
    assert set(salted.block_hashes).isdisjoint(other_salt)


def test_a_seed_in_the_environment_fixes_the_chain_and_bad_text_is_named(monkeypatch):
    seed = bytes(range(16))
    code = "from common.block_hash import NONE_HASH; print(NONE_HASH.hex())"
    env = {**os.environ, PREFIX_HASH_SEED_ENV: seed.hex()}
    printed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert printed.strip() == seed.hex()
    monkeypatch.setenv(PREFIX_HASH_SEED_ENV, "abc")
    with pytest.raises(ValueError, match=f"{PREFIX_HASH_SEED_ENV} must be 32 hex digits"):
        seed_from_env()
    monkeypatch.delenv(PREFIX_HASH_SEED_ENV)
    assert seed_from_env() != seed_from_env()  # random without the variable


# ---- the core's events ----------------------------------------------------------------------


def test_a_pool_logs_new_hashes_once_and_removes_them_when_the_last_copy_goes():
    pool = BlockPool(num_gpu_blocks=6)
    log = pool.enable_kv_cache_events()
    first, twin = (make_request(r, list(range(8)), block_size=BLOCK) for r in ("a", "b"))
    expected = [compact_block_hash(h) for h in first.block_hashes]
    first_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, first_blocks, 0, 2, BLOCK)
    twin_blocks = pool.get_new_blocks(2)  # the same content computed at the same time
    pool.cache_full_blocks(twin, twin_blocks, 0, 2, BLOCK)
    assert log.take() == KVCacheEvents(stored=expected)
    assert log.take() is None
    pool.free_blocks([*reversed(first_blocks), *reversed(twin_blocks)])
    pool.get_new_blocks(3)  # the free block first, then reuses (evicts) both of `first`'s
    assert log.take() is None  # the twin still holds both hashes
    pool.get_new_blocks(2)  # evicts the twin's: now both are gone
    assert log.take() == KVCacheEvents(removed=[expected[1], expected[0]])


def test_a_reset_clears_the_report_and_other_groups_are_not_logged():
    pool = BlockPool(num_gpu_blocks=6)
    log = pool.enable_kv_cache_events()
    request = make_request("a", list(range(8)), block_size=BLOCK)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, BLOCK, kv_cache_group_id=1)
    assert log.take() is None
    pool.cache_full_blocks(request, pool.get_new_blocks(2), 0, 2, BLOCK)
    pool.free_blocks(pool.blocks[1:5])
    assert pool.reset_prefix_cache()
    assert log.take() == KVCacheEvents(cleared=True)


def test_an_event_log_returns_what_happened_since_the_last_take():
    log = KVCacheEventLog()
    log.record_stored(b"\x01" + bytes(15))
    log.record_removed(b"\x02" + bytes(15))
    assert log.take() == KVCacheEvents([1], [2])
    log.record_stored(b"\x03" + bytes(15))
    log.record_cleared()
    log.record_stored(b"\x04" + bytes(15))
    assert log.take() == KVCacheEvents([4], [], True)


# ---- the router -----------------------------------------------------------------------------


def make_router(num_cores: int = 2, capacity: int = 1000) -> PrefixAwareRouter:
    return PrefixAwareRouter(num_cores, BLOCK, b"\x07" * 16, capacity)


def test_a_repeated_prefix_goes_to_the_core_that_holds_it():
    router = make_router()
    shared = list(range(100, 140))  # 10 blocks
    first = router.route([*shared, 1])
    router.finished(first, 41)
    for suffix in range(2, 8):
        core = router.route([*shared, suffix])
        assert core == first
        router.finished(core, 41)


def test_a_salted_prompt_routes_by_its_salted_prefix():
    router = make_router()
    shared = list(range(100, 140))  # 10 blocks
    salted_core = router.route([*shared, 1], "tenant-a")
    router.finished(salted_core, 41)
    # The same tokens unsalted or under another salt share nothing with the cached prefix:
    # idle cores tie, and the tie goes to the core chosen least recently.
    assert router.route([*shared, 2]) != salted_core
    router.finished(1 - salted_core, 41)
    assert router.route([*shared, 3], "tenant-b") == salted_core  # least recent again, no prefix
    router.finished(salted_core, 41)
    assert router.mirrors[salted_core].matched_blocks(router.block_hashes(shared)) == 0
    # The salt's own prompt goes back to its prefix, though that core was chosen last.
    assert router.route([*shared, 4], "tenant-a") == salted_core


def test_unrelated_prompts_spread_over_idle_cores_and_go_to_the_least_loaded():
    router = make_router(3)
    assert [router.route([n] * 9) for n in (1, 2, 3)] == [0, 1, 2]  # each idle core in turn
    router.generated(1, 50)
    router.finished(0, 9)
    assert router.route([4] * 9) == 0  # now the least loaded
    assert router.load_tokens == [9, 59, 9]


def test_finished_requests_leave_idle_cores_tied_and_ties_rotate():
    router = make_router(2)
    chosen = []
    for n in range(1, 5):
        core = router.route([n] * 8)
        chosen.append(core)
        router.finished(core, 8)
    assert chosen == [0, 1, 0, 1]


def test_a_prefix_wins_until_its_core_is_busier_than_the_prefix_saves():
    router = make_router(2)
    shared = list(range(200, 240))  # 40 cached tokens
    assert router.route([*shared, 1]) == 0
    # Core 0 holds the prefix and 41 tokens of load; core 1 is idle. Cost on core 0:
    # 41 + 41 - 40 = 42; on core 1: 41. Core 1 wins: the prefix saves less than the queue costs.
    assert router.route([*shared, 2]) == 1
    # Both hold it now (routed prompts count as cached): the less loaded one wins.
    router.finished(0, 41)
    assert router.route([*shared, 3]) == 0


def test_core_events_add_and_remove_hashes_and_a_clear_forgets_everything():
    router = make_router(2)
    hashes = router.block_hashes(list(range(12)))
    router.apply_events(1, KVCacheEvents(stored=hashes))
    assert router.choose(hashes, 12) == 1
    router.apply_events(1, KVCacheEvents(removed=hashes[1:]))
    assert router.mirrors[1].matched_blocks(hashes) == 1
    router.apply_events(1, KVCacheEvents(stored=[99], cleared=True))
    assert list(router.mirrors[1]._hashes) == [99]


def test_a_mirror_keeps_its_most_recent_hashes_within_capacity():
    mirror = CoreCacheMirror(capacity=3)
    mirror.add([1, 2, 3])
    mirror.add([1, 4])  # 1 refreshed, 2 is the oldest
    assert 2 not in mirror and all(h in mirror for h in (1, 3, 4))
    assert mirror.matched_blocks([1, 3, 5, 4]) == 2
    with pytest.raises(ValueError, match="capacity of at least 1, got 0"):
        CoreCacheMirror(0)
