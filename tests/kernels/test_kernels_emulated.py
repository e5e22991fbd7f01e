"""The CUDA backend end to end on the CPU: the real `.cu` kernels run in the CPU emulator.

`kernels.cuda.backend` is used unchanged except for three seams: the module loader compiles
kernels as host C++ (tests/helpers/cuda_cpu_emulator.py), launches skip CuPy and streams, and the
device reports 4 SMs so that small batches take the split-KV path. Every launch checks the
argument packing against the kernel's parameter sizes. This covers the kernels' logic, the
launcher's argument order, grids and split decisions; timing and the GPU memory model are left
to the `gpu` tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core_engine.common.dtypes import dtype_name
from core_engine.kernels import attention, torch_reference
from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda.warmup import warmup
from tests.helpers.cuda_cpu_emulator import EmulatedLoader, compiler_available, launch_on_cpu
from tests.helpers.paged_attention_cases import (
    assert_close_to_reference,
    assert_matches_torch_reference,
    drop_keys_before_window,
    make_case,
    naive_attention,
    write_new_tokens,
)

NUM_SMS = 4

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")


@pytest.fixture
def loader(monkeypatch) -> EmulatedLoader:
    emulated = EmulatedLoader()
    monkeypatch.setattr(cuda_backend, "default_loader", lambda: emulated)
    monkeypatch.setattr(cuda_backend, "_launch", launch_on_cpu)
    monkeypatch.setattr(cuda_backend, "_num_sms", lambda device_index: NUM_SMS)
    # Occupancy unknown, as without a GPU: decode splits by its CTAs-per-SM rule.
    monkeypatch.setattr(cuda_backend, "_resident_ctas_per_sm", lambda *args: None)
    monkeypatch.setattr(cuda_backend, "_max_shared_mem", lambda device_index: 227 * 1024)
    return emulated


def attend(case) -> torch.Tensor:
    """Cache write and attention through the CUDA backend (with the case's sliding window)."""
    cuda_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    return cuda_backend.paged_attention(
        case.query, case.kv_cache, case.metadata, case.scale, sliding_window=case.sliding_window
    )


def launched(loader: EmulatedLoader) -> set[str]:
    return {name for (_, name), kernel in loader.kernels.items() if kernel.num_launches}


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([1], [1], id="context-1"),
        pytest.param([15, 16, 17], [1, 1, 1], id="decode-block-pm1"),
        pytest.param([15, 16, 17], [15, 16, 17], id="prefill-block-pm1"),
        pytest.param([33, 16, 17, 70], [2, 16, 1, 1], id="chunked-and-decode"),
        pytest.param([5, 0, 9], [0, 0, 9], id="requests-without-tokens"),
        pytest.param([40, 130, 17, 300, 9], [5, 2, 1, 4, 3], id="draft-verification"),
    ],
)
def test_lengths(loader, seq_lens, q_lens):
    case = make_case(seq_lens, q_lens, 8, 2, 64, num_padding_tokens=2)
    assert_close_to_reference(case, attend(case))


def test_decode_batch_runs_only_the_decode_kernel(loader):
    case = make_case([3, 40], [1, 1], 4, 2, 64)
    assert_close_to_reference(case, attend(case))
    assert launched(loader) == {"reshape_and_cache", "decode_attention<float, 64, 2>"}


@pytest.mark.parametrize(
    ("dtype", "head_dim", "prefill_kernel"),
    [
        (torch.bfloat16, 64, "prefill_attention_tc<bf16_t, 64>"),
        (torch.float16, 32, "prefill_attention_tc<half_t, 32>"),
        (torch.float16, 80, "prefill_attention_tc<half_t, 80>"),  # copy phases straddle rows
        (torch.bfloat16, 256, "prefill_attention_tc<bf16_t, 256>"),  # Q re-read from smem
        (torch.bfloat16, 24, "prefill_attention<bf16_t, 24>"),
        (torch.float32, 64, "prefill_attention<float, 64>"),
    ],
)
def test_prefill_kernel_choice(loader, dtype, head_dim, prefill_kernel):
    """Tensor cores for fp16/bf16 with head_dim % 16 == 0: several query tiles and key tiles."""
    case = make_case([150, 70, 9], [150, 20, 9], 8, 2, head_dim, dtype=dtype)
    assert_close_to_reference(case, attend(case))
    assert prefill_kernel in launched(loader)


def test_mixed_batch_runs_prefill_and_decode_kernels(loader):
    case = make_case([3, 40], [3, 1], 4, 2, 64)
    assert_close_to_reference(case, attend(case))
    assert {"prefill_attention<float, 64>", "decode_attention<float, 64, 2>"} <= launched(loader)


@pytest.mark.parametrize(
    ("dtype", "prefill_kernel"),
    [
        (torch.float32, "prefill_attention<float, 64>"),
        (torch.bfloat16, "prefill_attention_tc<bf16_t, 64>"),
    ],
)
def test_draft_verification_queries_run_on_the_prefill_kernel_beside_decodes(
    loader, dtype, prefill_kernel
):
    """Speculative decoding's K + 1 query tokens over a long context are a short chunk: the
    prefill kernel takes them (bottom-right causal over several key tiles), the decode kernel
    the one-token requests of the same step."""
    case = make_case([40, 130, 17, 300, 9], [5, 2, 1, 4, 3], 8, 2, 64, dtype=dtype)
    assert_close_to_reference(case, attend(case))
    launched_kernels = launched(loader)
    assert prefill_kernel in launched_kernels
    assert any(name.startswith("decode_attention") for name in launched_kernels)


@pytest.mark.parametrize("group_size", [1, 3, 4, 7, 8, 12])
def test_gqa_groups(loader, group_size):
    case = make_case([9, 40, 23], [1, 12, 23], 2 * group_size, 2, 64, seed=group_size)
    assert_close_to_reference(case, attend(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 128, 256])
def test_head_dims_and_dtypes(loader, head_dim, dtype):
    case = make_case([20, 37, 5], [20, 1, 2], 4, 2, head_dim, dtype=dtype, seed=head_dim)
    out = attend(case)
    assert out.dtype == dtype
    assert_close_to_reference(case, out)


@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_block_sizes(loader, block_size):
    seq_lens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    case = make_case(seq_lens, [1, 4, block_size + 1, 1], 6, 3, 64, block_size=block_size)
    assert_close_to_reference(case, attend(case))


def test_split_kv_boundaries(loader):
    """Contexts one key short of, exactly at, and one past a split boundary, merged by lse."""
    num_reqs, max_seq_len = 5, 1100
    launch = lc.decode_launch(num_reqs, 4, 1, 64, max_seq_len, NUM_SMS)
    assert launch.needs_merge
    kps = launch.keys_per_split
    seq_lens = [kps - 1, kps, kps + 1, 2 * kps + 1, max_seq_len]
    case = make_case(seq_lens, [1] * num_reqs, 4, 1, 64, block_size=16)
    assert_close_to_reference(case, attend(case))
    assert "merge_attention_states<float>" in launched(loader)


def test_split_kv_in_bfloat16_with_gqa(loader):
    case = make_case([700, 3], [1, 1], 8, 2, 128, dtype=torch.bfloat16)
    assert_close_to_reference(case, attend(case))
    assert "merge_attention_states<bf16_t>" in launched(loader)


# --- tensor-core decode: fp16 / bf16 groups of >= 4 heads ----------------------------------------

TC_DECODE_CONFIGS = [
    pytest.param(torch.bfloat16, 64, 4, id="bf16-d64-g4"),
    pytest.param(torch.float16, 128, 7, id="fp16-d128-g7"),
    pytest.param(torch.bfloat16, 256, 8, id="bf16-d256-g8"),
    pytest.param(torch.float16, 64, 8, id="fp16-d64-g8"),
    pytest.param(torch.bfloat16, 128, 8, id="bf16-d128-g8"),
    pytest.param(torch.float16, 256, 4, id="fp16-d256-g4"),
    pytest.param(torch.bfloat16, 80, 12, id="bf16-d80-g12"),  # 2 chunks of 6 heads
    pytest.param(torch.float16, 96, 5, id="fp16-d96-g5"),
]


@pytest.mark.parametrize(("dtype", "head_dim", "group_size"), TC_DECODE_CONFIGS)
def test_tensor_core_decode_unsplit_and_split(grids, dtype, head_dim, group_size):
    """8 CTAs (unsplit) with contexts around a 16-key warp tile and a block, then 2 requests long
    enough to split, in one test so each kernel instance compiles once."""
    heads_per_cta, _ = lc.head_chunking(group_size)
    name = lc.decode_tc_kernel_name(dtype_name(dtype), head_dim, heads_per_cta)
    unsplit = make_case(
        [1, 16, 17, 63], [1, 1, 1, 1], 2 * group_size, 2, head_dim, dtype=dtype, seed=head_dim
    )
    assert_close_to_reference(unsplit, attend(unsplit))
    assert grids[name][-1][2] == 1 and "merge_attention_states" not in str(grids)
    split = make_case([700, 3], [1, 1], group_size, 1, head_dim, dtype=dtype, seed=group_size)
    assert_close_to_reference(split, attend(split))
    assert grids[name][-1][2] > 1
    assert any(key.startswith("merge_attention_states") for key in grids)


@pytest.mark.parametrize(("dtype", "head_dim", "group_size"), TC_DECODE_CONFIGS[:3])
@pytest.mark.parametrize("window", [1, 20, 520])
def test_tensor_core_decode_with_windows(grids, dtype, head_dim, group_size, window):
    """Windows starting inside blocks and warp tiles; the null block before them is NaN."""
    case = windowed_case(
        [700, 45, 530, 17], [1, 1, 1, 1], window, group_size, 1, head_dim, dtype=dtype
    )
    assert_windowed_output(case, attend(case))
    heads_per_cta, _ = lc.head_chunking(group_size)
    assert lc.decode_tc_kernel_name(dtype_name(dtype), head_dim, heads_per_cta) in grids


@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_block_sizes(loader, block_size, dtype):
    """Block index by shift (powers of two) or fast-divide (48), on both decode kernels."""
    seq_lens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 7]
    case = make_case(seq_lens, [1] * 5, 8, 2, 64, block_size=block_size, dtype=dtype)
    assert_close_to_reference(case, attend(case))
    kernel = "decode_attention_tc<bf16_t, 64, 4>" if dtype == torch.bfloat16 else None
    assert kernel is None or kernel in launched(loader)


def test_poisoned_slots_never_leak(loader):
    case = make_case([3, 17, 600], [3, 1, 1], 4, 2, 64, poison=True, num_padding_tokens=3)
    assert torch.isnan(case.kv_cache).any()
    assert_close_to_reference(case, attend(case))


def test_empty_batch_launches_nothing(loader):
    case = make_case([], [], 4, 2, 64)
    out = attend(case)
    assert out.shape == (0, 4, 64)
    assert launched(loader) == set()


def test_noncontiguous_query_and_foreign_dtype_out(loader):
    case = make_case([30, 6], [5, 1], 4, 2, 64, dtype=torch.bfloat16)
    write_new_tokens(case)
    fused = torch.cat([case.query, torch.zeros_like(case.query)], dim=1)  # a qkv-like parent
    query_view = fused[:, :4]
    assert not query_view.is_contiguous()
    out = torch.full(case.query.shape, float("nan"), dtype=torch.float32)
    returned = cuda_backend.paged_attention(
        query_view, case.kv_cache, case.metadata, case.scale, out=out
    )
    assert returned is out
    assert_close_to_reference(case, out.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cache_write_is_bit_exact_and_skips_negative_slots(loader, dtype):
    case = make_case([20, 5], [6, 5], 4, 2, 64, dtype=dtype, num_padding_tokens=4)
    expected = case.kv_cache.clone()
    flat_expected = expected.view(2, -1, 2, 64)
    valid = case.metadata.slot_mapping >= 0
    flat_expected[0, case.metadata.slot_mapping[valid]] = case.key[valid]
    flat_expected[1, case.metadata.slot_mapping[valid]] = case.value[valid]
    cuda_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(case.kv_cache.view(bits), expected.view(bits))


def test_cache_write_from_strided_views(loader):
    case = make_case([9], [9], 4, 2, 64)
    expected = case.kv_cache.clone()
    write_new_tokens(case)
    fused = torch.cat([case.key, case.value], dim=1)  # [T, 2 * H_kv, D]
    cuda_backend.reshape_and_cache(fused[:, :2], fused[:, 2:], expected, case.metadata.slot_mapping)
    assert torch.equal(expected.view(torch.int32), case.kv_cache.view(torch.int32))


def test_wrong_cache_layout_is_rejected_with_its_shape(loader):
    case = make_case([4], [4], 4, 2, 64)
    flat_cache = case.kv_cache.view(2, 4, 16, 128)
    with pytest.raises(ValueError, match=r"\(2, 4, 16, 128\)"):
        cuda_backend.paged_attention(case.query, flat_cache, case.metadata, case.scale)


def test_warmup_compiles_every_kernel_the_model_needs(loader, monkeypatch):
    monkeypatch.setattr(attention, "select_backend", lambda device: cuda_backend)
    warmup("cpu", torch.float32, num_heads=9, num_kv_heads=3, head_dim=64)
    assert launched(loader) == {
        "reshape_and_cache",
        "prefill_attention<float, 64>",
        "decode_attention<float, 64, 3>",
        "merge_attention_states<float>",
    }


def test_warmup_on_cpu_uses_the_reference(loader):
    warmup("cpu", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64)
    assert loader.num_compiled == 0


def test_engine_greedy_tokens_match_the_reference_backend(loader, monkeypatch, tmp_path):
    """A tiny random Llama through the in-process engine: emulated kernels vs the torch reference."""
    from core_engine.proto import SamplingParams
    from core_engine.proto.engine_config import EngineConfig
    from tests.helpers.engine_helpers import generate_token_ids
    from tests.helpers.model_fixtures import build_tiny_model_folder

    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (1, 40, 150)]
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,  # chunked prefill: prefill and decode kernels in one step
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy(backend) -> list[list[int]]:
        monkeypatch.setattr(attention, "select_backend", lambda device: backend)
        output = generate_token_ids(prompts, config, sampling_params=params)
        return [result.token_ids for result in output.results]

    with_kernels = greedy(cuda_backend)
    assert {"prefill_attention<float, 16>", "decode_attention<float, 16, 2>"} <= launched(loader)
    assert with_kernels == greedy(torch_reference)


# --- sliding window: keys before a query's window get weight 0 and are never read ------------


@pytest.fixture
def grids(loader, monkeypatch) -> dict[str, list[lc.Dim3]]:
    """The grids each kernel is launched with, by name expression."""
    launches: dict[str, list[lc.Dim3]] = {}

    def record(kernel, grid, block, args, shared_mem, device) -> None:
        launches.setdefault(kernel.name_expression, []).append(tuple(grid))
        launch_on_cpu(kernel, grid, block, args, shared_mem, device)

    monkeypatch.setattr(cuda_backend, "_launch", record)
    return launches


def windowed_case(seq_lens, q_lens, window, num_heads=8, num_kv_heads=2, head_dim=64, **kwargs):
    """A case whose blocks before each request's window are the null block, all of it NaN."""
    case = make_case(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, sliding_window=window, **kwargs
    )
    drop_keys_before_window(case)
    return case


def assert_windowed_output(case, out) -> None:
    """Finite, within the gate of the windowed fp64 definition, and equal to the torch reference
    (`torch_reference.paged_attention(..., sliding_window=W)`) on the same cache."""
    assert_close_to_reference(case, out)
    assert_matches_torch_reference(case, out)


def assert_window_matters(case) -> None:
    """The case tells a windowed kernel from one that ignores the window."""
    full = dataclasses.replace(case, sliding_window=None)
    assert (naive_attention(case) - naive_attention(full)).abs().max() > 0.05


@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [
        # windows start at 20, 50, 13 (inside blocks 1, 3 and 0) and 0 (17 keys)
        pytest.param([40, 70, 33, 17], 20, id="straddles-blocks"),
        pytest.param([48, 64, 80], 32, id="starts-on-blocks"),
        pytest.param([1, 16, 17, 40], 1, id="window-1"),
        pytest.param([15, 16, 17, 33], 2, id="window-2"),
    ],
)
def test_windowed_decode(loader, seq_lens, window):
    case = windowed_case(seq_lens, [1] * len(seq_lens), window, num_padding_tokens=2)
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))
    assert launched(loader) == {"reshape_and_cache", "decode_attention<float, 64, 4>"}


@pytest.mark.parametrize("window", [33, 34, 1000])
def test_windowed_decode_with_window_at_least_the_context(loader, window):
    """No key is before the window: the same as full attention."""
    case = windowed_case([33, 1, 20], [1, 1, 1], window)
    out = attend(case)
    assert_windowed_output(case, out)
    assert_close_to_reference(dataclasses.replace(case, sliding_window=None), out)


def test_windowed_decode_in_bfloat16_with_head_dim_128(loader):
    case = windowed_case([300, 45, 129], [1, 1, 1], 100, head_dim=128, dtype=torch.bfloat16)
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))


def test_windowed_split_kv_partitions_only_the_window(grids):
    """Splits sized by the window, not by the context: 2 splits of 384 window keys, so requests
    with a window of 383, 384 and 385 keys have an empty, no, and a one-key second split."""
    window, num_reqs = 600, 6
    launch = lc.decode_launch(num_reqs, 4, 1, 64, 1100, NUM_SMS, sliding_window=window)
    unwindowed = lc.decode_launch(num_reqs, 4, 1, 64, 1100, NUM_SMS)
    assert (launch.num_splits, launch.keys_per_split) == (2, 384)
    assert unwindowed.num_splits == 3
    kps = launch.keys_per_split
    seq_lens = [kps - 1, kps, kps + 1, window, window + 1, 1100]  # the last from key 500 on
    case = windowed_case(seq_lens, [1] * num_reqs, window, 4, 1, 64)
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))
    assert grids["decode_attention<float, 64, 4>"] == [(1, num_reqs, 2)]
    assert grids["merge_attention_states<float>"] == [(4, num_reqs, 1)]


def test_windowed_split_kv_in_bfloat16_with_gqa(grids):
    case = windowed_case([700, 3, 530], [1, 1, 1], 520, 8, 2, 128, dtype=torch.bfloat16)
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))
    assert grids["decode_attention_tc<bf16_t, 128, 4>"] == [(2, 3, 2)]
    assert "merge_attention_states<bf16_t>" in grids


class _NanEmptyTorch:
    """`torch` for cuda_backend whose `empty` is NaN: scratch the kernels do not write shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs) -> torch.Tensor:
        return torch.empty(*args, **kwargs).fill_(float("nan"))


def test_windowed_split_kv_with_more_splits_than_the_window_needs(grids, monkeypatch):
    """The kernels' contract for any split count: 4 splits of 256 keys over a 600-key window
    leave the last split of every request empty (and 2 of the 300-key one); the decode kernel
    writes nothing there and the merge reads only the splits that hold window keys."""
    monkeypatch.setattr(cuda_backend, "torch", _NanEmptyTorch())
    monkeypatch.setattr(lc, "split_keys", lambda max_keys, num_splits, policy: (4, 256))
    case = windowed_case([1100, 300, 601, 5], [1, 1, 1, 1], 600, 4, 1, 64)
    assert_windowed_output(case, attend(case))
    assert grids["decode_attention<float, 64, 4>"] == [(1, 4, 4)]
    assert "merge_attention_states<float>" in grids


@pytest.mark.parametrize("window", [100, 300])
def test_short_window_keeps_a_long_decode_unsplit(grids, window):
    """Fewer than 2 * min_keys_per_split window keys: one split, no merge, despite 1100 keys."""
    case = windowed_case([1100, 900], [1, 1], window, 4, 1, 64)
    assert_windowed_output(case, attend(case))
    assert grids["decode_attention<float, 64, 4>"] == [(1, 2, 1)]
    assert "merge_attention_states<float>" not in grids


PREFILL_KERNELS = [
    pytest.param(torch.float32, 64, "prefill_attention<float, 64>", id="cuda-cores-fp32"),
    pytest.param(torch.bfloat16, 24, "prefill_attention<bf16_t, 24>", id="cuda-cores-bf16"),
    pytest.param(torch.bfloat16, 64, "prefill_attention_tc<bf16_t, 64>", id="tensor-cores-bf16"),
    pytest.param(torch.float16, 32, "prefill_attention_tc<half_t, 32>", id="tensor-cores-fp16"),
]


@pytest.mark.parametrize(("dtype", "head_dim", "prefill_kernel"), PREFILL_KERNELS)
@pytest.mark.parametrize(
    "window",
    [
        pytest.param(7, id="window-7"),  # shorter than a query tile's 16 tokens
        pytest.param(40, id="window-40"),  # more than one 32-key tile, less than a 64-key one
        pytest.param(100, id="window-100"),  # more than one 64-key tile
    ],
)
def test_windowed_chunked_prefill(loader, dtype, head_dim, prefill_kernel, window):
    """Chunks after a context, several query tiles per request, tiles starting mid-block."""
    case = windowed_case(
        [150, 70, 9, 200], [100, 20, 9, 64], window, head_dim=head_dim, dtype=dtype, seed=window
    )
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))
    assert prefill_kernel in launched(loader)


@pytest.mark.parametrize(("dtype", "head_dim", "prefill_kernel"), PREFILL_KERNELS[::2])
@pytest.mark.parametrize("window", [1, 200, 500])
def test_windowed_prefill_with_window_1_and_at_least_the_context(
    loader, dtype, head_dim, prefill_kernel, window
):
    case = windowed_case([150, 70, 200], [100, 70, 64], window, head_dim=head_dim, dtype=dtype)
    assert_windowed_output(case, attend(case))
    assert prefill_kernel in launched(loader)


@pytest.mark.parametrize(
    ("dtype", "prefill_kernel", "decode_kernel"),
    [
        (torch.float32, "prefill_attention<float, 64>", "decode_attention<float, 64, 4>"),
        (torch.bfloat16, "prefill_attention_tc<bf16_t, 64>", "decode_attention_tc<bf16_t, 64, 4>"),
    ],
)
def test_windowed_mixed_decode_and_prefill_batch(loader, dtype, prefill_kernel, decode_kernel):
    case = windowed_case(
        [33, 16, 17, 700, 90, 5],
        [2, 16, 1, 1, 40, 0],
        24,
        dtype=dtype,
        num_padding_tokens=3,
    )
    assert_window_matters(case)
    assert_windowed_output(case, attend(case))
    assert {prefill_kernel, decode_kernel} <= launched(loader)


def test_null_block_before_the_window_is_never_read(loader):
    """Blocks wholly before the window are block 0, whose K and V are NaN (as are the replaced
    blocks and the slots before the window in the block straddling it): the output stays finite
    and equal to the reference; the same batch without the window does read them."""
    case = windowed_case([700, 90, 40], [1, 40, 1], 24, dtype=torch.bfloat16)
    block_table = case.metadata.block_table
    assert block_table[0, :42].eq(0).all() and block_table[0, 42] != 0  # 700 - 24 + 1 = 677
    assert block_table[1, :1].eq(0).all() and block_table[1, 1] != 0  # 50 - 24 + 1 = 27
    assert torch.isnan(case.kv_cache[:, 0]).all()
    out = attend(case)
    assert torch.isfinite(out[: case.num_real_tokens]).all()
    assert_windowed_output(case, out)
    unwindowed = cuda_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert torch.isnan(unwindowed[: case.num_real_tokens]).any()


def test_write_kv_and_attend_runs_windowed_layers_on_the_kernels(loader, monkeypatch):
    """No detour through the torch reference: the window goes to the CUDA kernels."""
    case = windowed_case([90, 300, 20], [40, 1, 1], 24)
    monkeypatch.setattr(attention, "select_backend", lambda device: cuda_backend)
    with monkeypatch.context() as patch:
        patch.setattr(torch_reference, "paged_attention", None)  # any call would fail
        out = attention.write_kv_and_attend(
            case.query, case.key, case.value, case.kv_cache, case.metadata, case.scale, 24
        )
    assert_windowed_output(case, out)
    assert {"prefill_attention<float, 64>", "decode_attention<float, 64, 4>"} <= launched(loader)


@pytest.mark.parametrize("window", [0, -3, 2**31])
def test_invalid_window_is_rejected_with_its_value(loader, window):
    case = make_case([4], [4], 4, 2, 64)
    with pytest.raises(ValueError, match=f"sliding_window={window}"):
        cuda_backend.paged_attention(
            case.query, case.kv_cache, case.metadata, case.scale, sliding_window=window
        )
