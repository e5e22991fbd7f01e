"""Grid, split and shared-memory decisions of the CUDA launchers (pure Python, no GPU)."""

from __future__ import annotations

import pytest

from core_engine.common.math_utils import cdiv
from core_engine.kernels.cuda import launch_config as lc

H100_SMS = 132


def test_large_decode_batch_is_not_split():
    launch = lc.decode_launch(64, 32, 8, 128, 4096, H100_SMS)
    assert launch.num_splits == 1
    assert not launch.needs_merge
    assert launch.keys_per_split == lc.UNSPLIT_KEYS_PER_SPLIT
    assert launch.grid == (8, 64, 1)
    assert launch.block == (lc.DECODE_THREADS, 1, 1)


def test_single_long_request_is_split_to_fill_the_gpu():
    launch = lc.decode_launch(1, 32, 8, 128, 32768, H100_SMS)
    assert launch.needs_merge
    # 8 CTAs unsplit; aim at 4 CTAs per SM -> 528 / 8 = 66 splits, capped at 64.
    assert launch.num_splits == 64
    assert launch.keys_per_split == 512
    assert launch.grid == (8, 1, 64)
    assert launch.merge_grid == (32, 1, 1)
    assert launch.num_splits * launch.keys_per_split >= 32768


def test_split_count_is_limited_by_context_length():
    launch = lc.decode_launch(1, 8, 8, 128, 1000, H100_SMS)
    # at least 256 keys per split -> 3 splits; 334 keys rounded up to 384.
    assert (launch.num_splits, launch.keys_per_split) == (3, 384)


def test_short_contexts_are_not_split():
    assert lc.decode_launch(1, 8, 1, 64, 300, H100_SMS).num_splits == 1
    assert lc.decode_launch(1, 8, 1, 64, 0, H100_SMS).num_splits == 1


def test_decode_splits_are_sized_by_the_sliding_window():
    """A windowed query attends to min(seq_len, window) keys: that, not the context, sets splits."""
    full = lc.decode_launch(1, 32, 8, 128, 32768, H100_SMS)
    windowed = lc.decode_launch(1, 32, 8, 128, 32768, H100_SMS, sliding_window=4096)
    assert (full.num_splits, full.keys_per_split) == (64, 512)
    assert (windowed.num_splits, windowed.keys_per_split) == (16, 256)  # 4096 / 256 keys
    assert windowed.num_splits * windowed.keys_per_split >= 4096
    assert lc.decode_launch(1, 32, 8, 128, 32768, H100_SMS, sliding_window=300).num_splits == 1
    wide = lc.decode_launch(1, 32, 8, 128, 1000, H100_SMS, sliding_window=5000)
    assert wide == lc.decode_launch(1, 32, 8, 128, 1000, H100_SMS)


def test_max_attended_keys():
    assert lc.max_attended_keys(1000, None) == 1000
    assert lc.max_attended_keys(1000, 24) == 24
    assert lc.max_attended_keys(10, 24) == 10


@pytest.mark.parametrize("window", [0, -1, 2**31])
def test_bad_sliding_windows_are_rejected_with_the_limit(window):
    with pytest.raises(ValueError, match=f"sliding_window={window}.*{2**31 - 1}"):
        lc.check_sliding_window(window)


def test_sliding_window_argument():
    assert lc.check_sliding_window(None) == 0
    assert lc.check_sliding_window(512) == 512


def test_split_threshold_is_two_ctas_per_sm():
    policy = lc.SplitPolicy()
    just_enough = policy.min_ctas_per_sm * H100_SMS
    assert lc.choose_num_splits(just_enough, 32768, H100_SMS, policy) == 1
    assert lc.choose_num_splits(just_enough - 1, 32768, H100_SMS, policy) == 2


@pytest.mark.parametrize("max_seq_len", [257, 511, 512, 513, 4095, 4096, 4097, 32768, 100_000])
@pytest.mark.parametrize("num_splits", [2, 3, 7, 64])
def test_split_keys_cover_the_context_without_empty_splits(max_seq_len, num_splits):
    splits, keys = lc.split_keys(max_seq_len, num_splits)
    if splits == 1:
        assert keys == lc.UNSPLIT_KEYS_PER_SPLIT
        return
    assert keys % lc.SplitPolicy().key_alignment == 0
    assert splits <= num_splits
    assert splits * keys >= max_seq_len
    assert (splits - 1) * keys < max_seq_len  # the last split holds keys


def test_head_chunking_keeps_groups_of_at_most_eight_in_one_cta():
    assert lc.head_chunking(1) == (1, 1)
    assert lc.head_chunking(3) == (3, 1)
    assert lc.head_chunking(8) == (8, 1)
    assert lc.head_chunking(12) == (6, 2)
    assert lc.head_chunking(16) == (8, 2)
    assert lc.head_chunking(17) == (6, 3)


def test_decode_grid_counts_head_chunks():
    launch = lc.decode_launch(5, 48, 4, 64, 100, H100_SMS)  # group 12 -> 2 chunks of 6
    assert (launch.heads_per_cta, launch.num_head_chunks) == (6, 2)
    assert launch.grid[:2] == (8, 5)


def test_decode_shared_memory_matches_kernel_layout_and_stays_under_48kb():
    assert lc.decode_shared_mem_bytes(4, 128) == 4 * 4 * 4 * (2 + 128)
    worst = lc.decode_shared_mem_bytes(lc.DECODE_MAX_HEADS_PER_CTA, lc.MAX_HEAD_DIM)
    assert worst <= lc.DEFAULT_SHARED_MEM_BYTES


def test_prefill_tiles_hold_whole_gqa_groups():
    for group in range(1, 65):
        tokens = lc.prefill_tokens_per_tile(group)
        assert tokens * group <= lc.PREFILL_ROWS
        assert (tokens + 1) * group > lc.PREFILL_ROWS
    with pytest.raises(ValueError, match="group size 65"):
        lc.prefill_tokens_per_tile(65)


def test_prefill_launch_grid():
    launch = lc.prefill_launch(3, 9, 3, 64, 100)  # SmolLM2 heads: group 3 -> 21 tokens per tile
    assert launch.tokens_per_tile == 21
    assert launch.grid == (5, 3, 3)
    assert launch.block == (lc.PREFILL_THREADS, 1, 1)


@pytest.mark.parametrize(
    ("dtype_name", "head_dim", "tensor_cores"),
    [
        ("bfloat16", 128, True),
        ("float16", 64, True),
        ("bfloat16", 80, True),
        ("bfloat16", 24, False),  # not a whole number of 16-wide MMA steps
        ("float32", 128, False),
    ],
)
def test_prefill_picks_tensor_cores_for_half_types(dtype_name, head_dim, tensor_cores):
    launch = lc.prefill_launch(2, 32, 8, head_dim, 300, dtype_name)
    assert launch.uses_tensor_cores is tensor_cores
    if tensor_cores:
        assert launch.source_name == "prefill_attention_tc.cu"
        assert launch.kernel_name == lc.prefill_tc_kernel_name(dtype_name, head_dim)
        assert launch.block == (lc.PREFILL_TC_THREADS, 1, 1)
        assert launch.shared_mem_bytes == lc.prefill_tc_shared_mem_bytes(head_dim)
    else:
        assert launch.source_name == "prefill_attention.cu"
        assert launch.kernel_name == lc.prefill_kernel_name(dtype_name, head_dim)
    assert launch.grid == (cdiv(300, 16), 2, 8)


def test_tensor_core_prefill_shared_memory():
    # Two stages of K and V tiles [64][d+8] (Q staged in one of them up to head_dim 128).
    assert lc.prefill_tc_shared_mem_bytes(128) == 2 * 4 * 64 * 136
    assert lc.prefill_tc_shared_mem_bytes(256) == 2 * 5 * 64 * 264
    assert lc.prefill_tc_shared_mem_bytes(64) <= lc.DEFAULT_SHARED_MEM_BYTES
    assert lc.prefill_tc_shared_mem_bytes(256) <= 227 * 1024


def test_prefill_shared_memory():
    assert lc.prefill_shared_mem_bytes(64) == 4 * (128 * 68 + 64 * 33)
    assert lc.prefill_shared_mem_bytes(128) > lc.DEFAULT_SHARED_MEM_BYTES  # needs the opt-in
    assert lc.prefill_shared_mem_bytes(256) <= 227 * 1024  # fits an H100 / H200


def test_cache_write_launch():
    launch = lc.cache_write_launch(7, 8 * 128 * 2)
    assert launch.row_vecs == 128
    assert launch.grid == (7, 1, 1)
    assert launch.block == (128, 1, 1)
    assert lc.cache_write_launch(1, 64 * 2).block == (32, 1, 1)
    with pytest.raises(ValueError, match="24 bytes"):
        lc.cache_write_launch(1, 24)


@pytest.mark.parametrize("head_dim", [0, 4, 12, 264, 512])
def test_unsupported_head_dims_are_rejected_with_the_limit(head_dim):
    with pytest.raises(ValueError, match=f"head_dim={head_dim}.*256"):
        lc.decode_launch(1, 4, 2, head_dim, 10, H100_SMS)


def test_heads_must_form_whole_groups():
    with pytest.raises(ValueError, match="num_heads=6.*num_kv_heads=4"):
        lc.prefill_launch(1, 6, 4, 64, 10)


def test_too_many_requests_for_one_grid_are_rejected():
    with pytest.raises(ValueError, match="num_reqs=70000"):
        lc.decode_launch(70_000, 4, 4, 64, 10, H100_SMS)


def test_kernel_name_expressions():
    assert lc.decode_kernel_name("bfloat16", 128, 4) == "decode_attention<bf16_t, 128, 4>"
    assert lc.prefill_kernel_name("float16", 64) == "prefill_attention<half_t, 64>"
    assert lc.merge_kernel_name("float32") == "merge_attention_states<float>"
    with pytest.raises(ValueError, match="float64"):
        lc.decode_kernel_name("float64", 64, 1)


@pytest.mark.parametrize(
    ("dtype_name", "group_size", "tensor_cores"),
    [
        ("bfloat16", 4, True),
        ("float16", 8, True),
        ("bfloat16", 12, True),  # two chunks of 6 heads
        ("bfloat16", 3, False),
        ("float16", 1, False),
        ("float32", 8, False),  # no fp32 tensor-core path: tf32 would lose precision
    ],
)
def test_decode_picks_tensor_cores_for_half_types_and_groups_of_four(
    dtype_name, group_size, tensor_cores
):
    launch = lc.decode_launch(64, 2 * group_size, 2, 128, 4096, H100_SMS, dtype_name=dtype_name)
    assert launch.uses_tensor_cores is tensor_cores
    name = lc.decode_tc_kernel_name if tensor_cores else lc.decode_kernel_name
    assert launch.kernel_name == name(dtype_name, 128, launch.heads_per_cta)
    assert launch.shared_mem_bytes == lc.decode_shared_mem_bytes(launch.heads_per_cta, 128)


def test_decode_defaults_to_the_cuda_core_kernel():
    launch = lc.decode_launch(1, 8, 1, 64, 10, H100_SMS)
    assert launch.kernel_name == "decode_attention<float, 64, 8>"


@pytest.mark.parametrize("block_size", [1, 2, 16, 32, 48, 80, 128, 1000])
def test_block_divider_divides_every_int32_position(block_size):
    magic, shift = lc.block_divider(block_size)
    if block_size & (block_size - 1) == 0:
        assert (magic, shift) == (0, block_size.bit_length() - 1)  # a plain shift
    positions = [*range(4 * block_size + 3), 2**31 - 1, 2**31 - 2, 2**30 + 12345, 987654321]
    for pos in positions:
        assert (((pos * magic) >> 32) + pos) >> shift == pos // block_size
        assert (magic * pos) >> 32 < 2**32 and ((magic * pos) >> 32) + pos < 2**32


def test_block_divider_rejects_an_empty_block():
    with pytest.raises(ValueError, match="block_size=0"):
        lc.block_divider(0)


def test_with_the_kernels_occupancy_splits_fill_the_last_wave():
    """First GPU run: 512 unsplit CTAs of the tensor-core decode (3 resident per SM, 396 at
    once on 132 SMs) ran a full wave and then a wave of 116; three splits run 1,536 CTAs in
    four nearly full waves of 1,408-key splits (cost 4 x 1,472 against 2 x 4,160)."""
    assert lc.choose_num_splits(512, 4096, H100_SMS, resident_ctas_per_sm=3) == 3
    # The CUDA-core kernel for group 1 holds 4 per SM: 512 CTAs are one wave already.
    assert lc.choose_num_splits(512, 4096, H100_SMS, resident_ctas_per_sm=4) == 1
    # One request: as many splits as one wave holds, each at least min_keys_per_split.
    launch = lc.decode_launch(1, 32, 8, 128, 32768, H100_SMS, resident_ctas_per_sm=3,
                              dtype_name="bfloat16")  # fmt: skip
    assert launch.grid[0] * launch.num_splits <= 3 * H100_SMS
    assert launch.num_splits * launch.keys_per_split >= 32768
    assert launch.num_splits > 32
    # Short contexts are never split below min_keys_per_split keys.
    assert lc.choose_num_splits(8, 300, H100_SMS, resident_ctas_per_sm=3) == 1


@pytest.mark.parametrize("num_base_ctas", [1, 7, 100, 396, 397, 512, 2048, 8192])
@pytest.mark.parametrize("max_keys", [256, 1000, 4096, 32768])
def test_wave_split_is_never_predicted_slower_than_unsplit(num_base_ctas, max_keys):
    policy = lc.SplitPolicy()
    wave = 3 * H100_SMS

    def cost(splits):
        splits, keys = lc.split_keys(max_keys, splits, policy)
        keys = max_keys if splits == 1 else keys
        return cdiv(num_base_ctas * splits, wave) * (keys + policy.split_overhead_keys)

    most = min(policy.max_splits, max(1, max_keys // policy.min_keys_per_split))
    chosen = lc.choose_num_splits(num_base_ctas, max_keys, H100_SMS, policy, 3)
    assert 1 <= chosen <= most
    assert cost(chosen) <= cost(1)
    assert all(cost(chosen) <= cost(n) for n in range(1, most + 1))


def test_decode_kernel_name_for_matches_the_launch():
    for dtype in ("float32", "bfloat16"):
        for group in (1, 3, 4, 8, 12):
            launch = lc.decode_launch(4, 2 * group, 2, 128, 1000, H100_SMS, dtype_name=dtype)
            assert lc.decode_kernel_name_for(dtype, 128, group) == launch.kernel_name
