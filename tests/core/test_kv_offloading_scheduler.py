"""The OffloadingConnector's scheduler side, block by block: what is stored where, what a lookup
finds, what loads into which block, what is evicted, and how a request waits for its KV
(WAITING_FOR_REMOTE_KVS) while the others step."""

from __future__ import annotations

import pytest

from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_connector.kv_connector_factory import make_kv_connector
from core_engine.core.kv_connector.tier_index import TierIndex
from core_engine.core.request import RequestStatus
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.kv_transfer import BlockLoad, BlockStore
from tests.core.kv_offloading_fakes import (
    BYTES_PER_BLOCK,
    FakeTiers,
    make_offloading_scheduler,
    step,
)
from tests.helpers.core_factories import BLOCK_SIZE, fake_model_output, make_request

PROMPT_A = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 and one token
PROMPT_B = list(range(200, 229))  # 29 tokens: takes all 8 usable blocks of the pool


def run_a_then_b(scheduler, tiers):
    """A computes and finishes (its 3 full blocks stored), then B takes the whole pool,
    evicting A's blocks from it. Returns A's block hashes."""
    request_a = make_request("a", PROMPT_A, max_tokens=1)
    scheduler.add_request(request_a)
    first = step(scheduler, tiers)
    scheduler.add_request(make_request("b", PROMPT_B, max_tokens=1))
    step(scheduler, tiers)
    assert scheduler.kv_cache_manager.get_computed_blocks(make_request("x", PROMPT_A))[1] == 0
    return request_a.block_hashes, first


def test_every_full_block_is_stored_once_in_the_step_that_computes_it():
    scheduler = make_offloading_scheduler(num_host_blocks=16)
    tiers = FakeTiers()
    hashes_a, first = run_a_then_b(scheduler, tiers)
    assert first.kv_connector_metadata.stores == [
        BlockStore(1, 0, None),
        BlockStore(2, 1, None),
        BlockStore(3, 2, None),
    ]
    assert scheduler.connector.host.hashes_lru_first()[:3] == hashes_a
    assert [tiers.host[slot] for slot in range(3)] == hashes_a
    assert len(scheduler.connector.host) == 3 + 7  # B's 29 tokens fill 7 blocks
    stats = scheduler.get_stats()
    assert stats.kv_offload_host_bytes == 10 * BYTES_PER_BLOCK


def test_a_prefix_evicted_from_the_pool_loads_from_the_host_tier_while_others_step():
    scheduler = make_offloading_scheduler(num_host_blocks=16)
    tiers = FakeTiers()
    hashes_a, _ = run_a_then_b(scheduler, tiers)
    again = make_request("a2", PROMPT_A, max_tokens=2)
    other = make_request("c", [7, 8, 9], max_tokens=2)
    assert scheduler.connector.get_num_new_matched_tokens(again, 0) == (12, True)
    scheduler.add_request(again)
    scheduler.add_request(other)

    loading_step = step(scheduler, tiers)
    (load,) = loading_step.kv_connector_metadata.loads
    assert load.req_id == "a2"
    assert load.blocks == [BlockLoad(1, 0), BlockLoad(2, 1), BlockLoad(3, 2)]
    assert list(loading_step.num_scheduled_tokens) == ["c"]  # the other request stepped
    # Back in the queue holding nothing: its loaded blocks wait in the prefix cache.
    assert again.status == RequestStatus.WAITING
    assert scheduler.kv_cache_manager.get_block_ids("a2") == ([],)
    assert [tiers.device[block_id] for block_id in (1, 2, 3)] == hashes_a
    hit = scheduler.kv_cache_manager.get_computed_blocks(make_request("x", PROMPT_A))
    assert hit[1] == 12

    running_step = step(scheduler, tiers)
    (new_req,) = running_step.scheduled_new_reqs
    assert (new_req.req_id, new_req.num_computed_tokens) == ("a2", 12)
    assert new_req.block_ids[0][:3] == [1, 2, 3]
    assert running_step.num_scheduled_tokens["a2"] == 1
    stats = scheduler.get_stats()
    assert stats.external_prefix_cache_queries == 13 + 29 + 13 + 3
    assert stats.external_prefix_cache_hits == 12
    assert again.num_cached_tokens == 12


def test_a_lookup_never_covers_the_last_token():
    scheduler = make_offloading_scheduler(num_host_blocks=16)
    tiers = FakeTiers()
    run_a_then_b(scheduler, tiers)
    exactly_three_blocks = make_request("d", PROMPT_A[:12], max_tokens=1)
    assert scheduler.connector.get_num_new_matched_tokens(exactly_three_blocks, 0) == (8, True)
    assert scheduler.connector.get_num_new_matched_tokens(exactly_three_blocks, 4) == (4, True)
    unrelated = make_request("e", [1] * 13)
    assert scheduler.connector.get_num_new_matched_tokens(unrelated, 0) == (0, False)


def test_a_full_host_tier_evicts_least_recently_used_and_never_blocks():
    scheduler = make_offloading_scheduler(num_host_blocks=3)
    tiers = FakeTiers()
    request_a = make_request("a", PROMPT_A, max_tokens=1)
    scheduler.add_request(request_a)
    step(scheduler, tiers)
    request_b = make_request("b", PROMPT_B, max_tokens=1)
    scheduler.add_request(request_b)
    second = step(scheduler, tiers)
    # B's first three blocks evict A's three; its later four find every slot pinned this step.
    assert second.kv_connector_metadata.stores == [
        BlockStore(block_id, slot, None) for block_id, slot in ((5, 0), (6, 1), (7, 2))
    ]
    assert scheduler.connector.host.hashes_lru_first() == request_b.block_hashes[:3]


def test_a_block_found_again_becomes_most_recently_used():
    scheduler = make_offloading_scheduler(num_host_blocks=8)
    tiers = FakeTiers()
    request_a = make_request("a", PROMPT_A, max_tokens=1)
    scheduler.add_request(request_a)
    step(scheduler, tiers)
    shares_two_blocks = make_request("d", PROMPT_A[:8] + [1, 2, 3, 4, 5], max_tokens=1)
    scheduler.add_request(shares_two_blocks)
    second = step(scheduler, tiers)
    assert [s.host_slot for s in second.kv_connector_metadata.stores] == [3]  # its third block
    h = request_a.block_hashes
    assert scheduler.connector.host.hashes_lru_first() == [
        h[2],
        h[0],
        h[1],
        shares_two_blocks.block_hashes[2],
    ]


def test_disk_tier_takes_what_the_host_tier_cannot_and_deletes_its_evictions():
    scheduler = make_offloading_scheduler(num_host_blocks=1, num_disk_blocks=2)
    tiers = FakeTiers()
    request_a = make_request("a", PROMPT_A, max_tokens=1)
    scheduler.add_request(request_a)
    first = step(scheduler, tiers)
    h = request_a.block_hashes
    assert first.kv_connector_metadata.stores == [
        BlockStore(1, 0, h[0]),
        BlockStore(2, None, h[1]),
    ]
    request_b = make_request("b", PROMPT_B, max_tokens=1)
    scheduler.add_request(request_b)
    second = step(scheduler, tiers)
    assert second.kv_connector_metadata.disk_deletes == [h[0], h[1]]
    assert set(tiers.disk) == set(request_b.block_hashes[:2])
    assert scheduler.connector.disk.hashes_lru_first() == request_b.block_hashes[:2]


def test_a_disk_block_loads_through_a_host_slot_when_one_can_be_freed():
    scheduler = make_offloading_scheduler(num_host_blocks=2, num_disk_blocks=16)
    tiers = FakeTiers()
    hashes_a, _ = run_a_then_b(scheduler, tiers)
    assert not any(h in scheduler.connector.host for h in hashes_a)  # B's blocks replaced them
    again = make_request("a2", PROMPT_A, max_tokens=1)
    scheduler.add_request(again)
    loading_step = step(scheduler, tiers)
    (load,) = loading_step.kv_connector_metadata.loads
    assert [(b.host_slot is not None, b.disk_hash) for b in load.blocks] == [
        (True, hashes_a[0]),
        (True, hashes_a[1]),
        (False, hashes_a[2]),  # both host slots are pinned by the first two this step
    ]
    assert [tiers.device[b.block_id] for b in load.blocks] == hashes_a
    assert scheduler.kv_cache_manager.get_computed_blocks(again)[1] == 12
    assert set(scheduler.connector.host.hashes_lru_first()) == set(hashes_a[:2])


def test_a_failed_load_forgets_the_bad_block_and_the_request_computes_its_prompt():
    scheduler = make_offloading_scheduler(num_host_blocks=1, num_disk_blocks=16)
    tiers = FakeTiers()
    hashes_a, _ = run_a_then_b(scheduler, tiers)
    tiers.bad_disk_hashes.add(hashes_a[1])  # a truncated or foreign file
    again = make_request("a2", PROMPT_A, max_tokens=1)
    scheduler.add_request(again)
    step(scheduler, tiers)
    assert again.status == RequestStatus.WAITING
    assert again.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.get_block_ids("a2") == ([],)
    assert hashes_a[1] not in scheduler.connector.disk
    assert scheduler.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    recompute = step(scheduler, tiers)
    (new_req,) = recompute.scheduled_new_reqs
    assert (new_req.req_id, new_req.num_computed_tokens) == ("a2", 0)
    assert recompute.num_scheduled_tokens["a2"] == 13
    assert not recompute.kv_connector_metadata.loads


def test_an_abort_while_loading_frees_the_blocks_and_ignores_the_late_report():
    scheduler = make_offloading_scheduler(num_host_blocks=16)
    tiers = FakeTiers()
    run_a_then_b(scheduler, tiers)
    scheduler.add_request(make_request("a2", PROMPT_A, max_tokens=1))
    scheduler_output = scheduler.schedule()
    assert scheduler.requests["a2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.get_stats().num_waiting_reqs == 1
    scheduler.finish_requests("a2", RequestStatus.FINISHED_ABORTED)
    model_output = fake_model_output(scheduler, scheduler_output)
    model_output.kv_connector_output = tiers.transfer(scheduler_output.kv_connector_metadata)
    scheduler.update_from_output(scheduler_output, model_output)
    scheduler.kv_cache_manager.check_integrity()
    scheduler.connector.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_preempted_request_resumes_from_the_tier():
    """p and q outgrow a pool of 6 blocks: q is preempted, p's new blocks evict q's cached
    ones from the pool, and q comes back through the host tier."""
    scheduler = make_offloading_scheduler(num_host_blocks=32, num_gpu_blocks=7, max_model_len=24)
    tiers = FakeTiers()
    scheduler.add_request(make_request("p", [300, 301, 302, 303, 304], max_tokens=14))
    scheduler.add_request(make_request("q", [400, 401, 402, 403, 404], max_tokens=14))
    resumed = None
    for _ in range(40):
        loads = step(scheduler, tiers).kv_connector_metadata.loads
        if loads:
            (resumed,) = loads
            break
    assert resumed is not None, "no request was preempted and reloaded"
    request = scheduler.requests[resumed.req_id]
    assert (request.request_id, request.num_preemptions) == ("q", 1)
    num_loaded = len(resumed.blocks)
    resume = step(scheduler, tiers)
    (cached,) = [c for c in resume.scheduled_cached_reqs if c.req_id == "q"]
    assert cached.resumed_from_preemption
    num_local = cached.num_computed_tokens // 4 - num_loaded  # its hit still in the pool
    assert num_local >= 0
    loaded_ids = cached.new_block_ids[0][num_local : num_local + num_loaded]
    assert loaded_ids == [b.block_id for b in resumed.blocks]
    loaded_hashes = request.block_hashes[num_local : num_local + num_loaded]
    assert [tiers.device[block_id] for block_id in loaded_ids] == loaded_hashes


def test_tier_index_pins_protect_a_step_and_capacity_bounds_it():
    index = TierIndex(2)
    assert index.allocate(b"a") == (0, None)
    assert index.allocate(b"b") == (1, None)
    index.pin(b"a")
    assert index.allocate(b"c") == (1, b"b")
    index.pin(b"c")
    assert index.allocate(b"d") is None
    index.unpin_all()
    assert index.allocate(b"d") == (0, b"a")
    index.check_integrity()
    with pytest.raises(ValueError, match="at least 1 block"):
        TierIndex(0)


def test_a_hybrid_model_is_refused_with_the_flag_that_fixes_it():
    config = EngineConfig(kv_offloading_size=1.0)
    hybrid = KVCacheConfig.for_layers([4, None], 4, 32, hybrid=True)
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache"):
        make_kv_connector(config, [], hybrid)


def test_the_start_up_line_gives_each_tier_in_bytes_and_blocks():
    scheduler = make_offloading_scheduler(num_host_blocks=2**20, num_disk_blocks=3 * 2**20)
    assert scheduler.connector.describe() == (
        f"KV offloading (OffloadingConnector): host tier {2**20 * BYTES_PER_BLOCK / 2**30:.2f} "
        f"GiB = 1048576 blocks, disk tier {3 * 2**20 * BYTES_PER_BLOCK / 2**30:.2f} GiB = "
        f"3145728 blocks of {BLOCK_SIZE} tokens, for prefix hits beyond the KV cache"
    )
