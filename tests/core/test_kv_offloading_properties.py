"""Property test: random add / step / abort sequences with the OffloadingConnector keep the pool
and the tiers sound, and every block a running request computed (itself, from the prefix cache
or loaded from a tier) holds its own hash's KV."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_engine.core.request import RequestStatus
from tests.core.kv_offloading_fakes import FakeTiers, make_offloading_scheduler, step
from tests.helpers.core_factories import make_request

actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 2), min_size=1, max_size=28),  # few symbols: shared prefixes
            st.integers(1, 6),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 100)),
    ),
    max_size=50,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_gpu_blocks=st.integers(9, 14),
    num_host_blocks=st.integers(1, 12),
    num_disk_blocks=st.sampled_from([None, 1, 3, 20]),
    budget=st.integers(4, 40),
    bad_disk=st.booleans(),
)
def test_random_interleavings_keep_tiers_and_blocks_sound(
    actions, num_gpu_blocks, num_host_blocks, num_disk_blocks, budget, bad_disk
):
    scheduler = make_offloading_scheduler(
        num_host_blocks,
        num_disk_blocks,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=3,
    )
    tiers = FakeTiers()
    added = []
    for action in actions:
        if action[0] == "add":
            request_id = f"r{len(added)}"
            scheduler.add_request(make_request(request_id, action[1], max_tokens=action[2]))
            added.append(request_id)
        elif action[0] == "step":
            if bad_disk and tiers.disk:  # a file damaged on disk since it was written
                tiers.bad_disk_hashes.add(next(iter(tiers.disk)))
            step(scheduler, tiers)
        elif added:
            scheduler.finish_requests(added[action[1] % len(added)], RequestStatus.FINISHED_ABORTED)
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, tiers)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
