"""common.kv_cache_groups: the layer grouping the core and the workers both derive."""

from __future__ import annotations

import pytest

from core_engine.common.kv_cache_groups import KVCacheGroup, group_layers, layers_per_group


def test_one_attention_type_is_one_group_of_every_layer():
    groups = group_layers([None] * 30)
    assert groups == [KVCacheGroup(None, tuple(range(30)))]
    assert layers_per_group(groups) == 30


def test_gemma3_layers_form_one_full_group_and_five_window_groups_of_three():
    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    groups = group_layers(windows)
    assert groups == [
        KVCacheGroup(None, (5, 11, 17)),
        KVCacheGroup(512, (0, 1, 2)),
        KVCacheGroup(512, (3, 4, 6)),
        KVCacheGroup(512, (7, 8, 9)),
        KVCacheGroup(512, (10, 12, 13)),
        KVCacheGroup(512, (14, 15, 16)),
    ]
    assert layers_per_group(groups) == 3


def test_disabled_hybrid_groups_are_one_full_attention_group_of_every_layer():
    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    assert group_layers(windows, hybrid=False) == [KVCacheGroup(None, tuple(range(18)))]


def test_the_core_config_follows_the_same_switch():
    from core_engine.core.kv_cache.kv_cache_spec import (
        FullAttentionSpec,
        KVCacheConfig,
        SlidingWindowSpec,
    )

    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    hybrid = KVCacheConfig.for_layers(windows, 16, 4096)
    assert hybrid.kv_cache_groups == (FullAttentionSpec(16),) + (SlidingWindowSpec(16, 512),) * 5
    disabled = KVCacheConfig.for_layers(windows, 16, 4096, hybrid=False)
    assert disabled.kv_cache_groups == (FullAttentionSpec(16),)


def test_a_window_wider_than_max_model_len_is_clipped_at_start_up_not_an_error():
    """Such a window frees nothing (vLLM treats it as full attention too); the groups keep
    the workers' layout."""
    from core_engine.core.kv_cache.kv_cache_spec import (
        FullAttentionSpec,
        KVCacheConfig,
        SlidingWindowSpec,
    )

    config = KVCacheConfig.for_layers([None, 8192, None, 8192], 16, 4096)
    assert config.kv_cache_groups == (FullAttentionSpec(16), SlidingWindowSpec(16, 4096))


def test_group_size_is_the_gcd_of_the_layer_counts_and_windows_sort_by_size():
    windows = [4096, None, 1024, None, 4096, None, 1024, None]
    groups = group_layers(windows)
    assert [g.sliding_window for g in groups] == [None, None, 1024, 4096]
    assert [g.layer_indices for g in groups] == [(1, 3), (5, 7), (2, 6), (0, 4)]


@pytest.mark.parametrize(
    ("windows", "message"),
    [([], "at least one layer"), ([None, 0], "layer 1 has sliding window 0; it must be >= 1")],
)
def test_bad_layer_windows_are_clear_errors(windows, message):
    with pytest.raises(ValueError, match=message):
        group_layers(windows)
