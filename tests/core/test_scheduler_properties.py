"""Property test: random interleavings of add / schedule / update / abort keep the pool sound."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_engine.core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from core_engine.core.request import RequestStatus
from core_engine.proto.speculative_config import SpeculativeConfig
from tests.helpers.core_factories import (
    BLOCK_SIZE,
    check_spec_decode_integrity,
    fake_model_output,
    make_request,
    make_scheduler,
)

actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 3), min_size=1, max_size=30),  # few symbols: prefix hits
            st.integers(1, 12),
            st.integers(0, 3),
        ),
        st.tuples(st.just("step"), st.integers(0, 2**31)),
        st.tuples(st.just("abort"), st.integers(0, 100)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_gpu_blocks=st.integers(9, 24),
    budget=st.integers(1, 40),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    sliding_window=st.sampled_from([None, 1, 4, 5, 9]),
    num_speculative_tokens=st.sampled_from([None, 1, 3]),
)
def test_random_interleavings_keep_invariants(
    actions, num_gpu_blocks, budget, policy, caching, sliding_window, num_speculative_tokens
):
    kv_cache_config = None
    if sliding_window is not None:  # hybrid: a full-attention and a sliding-window group
        groups = (FullAttentionSpec(BLOCK_SIZE), SlidingWindowSpec(BLOCK_SIZE, sliding_window))
        kv_cache_config = KVCacheConfig(groups, max_model_len=32)
        num_gpu_blocks += 8  # room for a max_model_len request in both groups
    scheduler = make_scheduler(
        kv_cache_config=kv_cache_config,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=32,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        policy=policy,
        enable_prefix_caching=caching,
        speculative_config=num_speculative_tokens
        and SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=1
        ),
    )
    pool = scheduler.kv_cache_manager.block_pool
    added = []
    for action in actions:
        if action[0] == "add":
            _, prompt, max_tokens, priority = action
            request_id = f"r{len(added)}"
            scheduler.add_request(
                make_request(
                    request_id, prompt, max_tokens=max_tokens, priority=priority, eos_token_id=0
                )
            )
            added.append(request_id)
        elif action[0] == "step":
            seed = action[1]
            output = scheduler.schedule()
            _check_output_consistency(scheduler, output)
            runner_output = fake_model_output(
                scheduler, output, lambda r, seed=seed: (seed + r.num_tokens) % 4
            )
            scheduler.update_from_output(output, runner_output)
        elif added:
            scheduler.finish_requests(added[action[1] % len(added)], RequestStatus.FINISHED_ABORTED)
        scheduler.kv_cache_manager.check_integrity()
        check_spec_decode_integrity(scheduler)
        _check_block_ownership(scheduler)

    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.update_from_output(output, fake_model_output(scheduler, output, lambda r: 1))
        scheduler.kv_cache_manager.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert pool.get_num_free_blocks() == num_gpu_blocks - 1
    assert scheduler.kv_cache_manager.usage == 0.0


def _check_output_consistency(scheduler, output):
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
    assert output.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    listed = [r.req_id for r in output.scheduled_new_reqs]
    listed += [r.req_id for r in output.scheduled_cached_reqs]
    assert sorted(listed) == sorted(output.num_scheduled_tokens)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs


def _check_block_ownership(scheduler):
    """Every non-null block a request holds, in any group, is referenced once per holder."""
    manager = scheduler.kv_cache_manager
    holders = {}
    for request_id in scheduler.requests:
        for group_block_ids in manager.get_block_ids(request_id):
            for block_id in group_block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
    holders.pop(manager.block_pool.null_block.block_id, None)
    for block_id, count in holders.items():
        assert manager.block_pool.blocks[block_id].ref_cnt == count
