"""The torch reference backend against a naive dense attention, on CPU.

Covers the KERNELS.md cases: context 1, block_size +-1, mixed lengths (prefill, chunked prefill
and decode in one batch), GQA groups 1/3/4/7/8, head_dim 64/128/256, NaN-poisoned unused cache
slots (every case), an empty batch, and bit-exact cache writes that leave -1 slots untouched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core_engine.kernels import attention, select_backend, torch_reference, write_kv_and_attend
from core_engine.kernels.cpu import backend as cpu_backend
from core_engine.kernels.cuda import backend as cuda_backend
from tests.helpers.paged_attention_cases import make_case, naive_attention, write_new_tokens

ATOL_FP32 = 1e-5


def run_reference(case) -> torch.Tensor:
    torch_reference.reshape_and_cache(
        case.key, case.value, case.kv_cache, case.metadata.slot_mapping
    )
    return torch_reference.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)


def assert_matches_naive(case, out: torch.Tensor, atol: float = ATOL_FP32) -> None:
    real = out[: case.num_real_tokens]
    assert not torch.isnan(real).any(), "NaN leaked from unused cache slots"
    expected = naive_attention(case)
    torch.testing.assert_close(real.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([1], [1], id="context-1"),
        pytest.param([15, 16, 17], [1, 1, 1], id="decode-block-pm1"),
        pytest.param([15, 16, 17], [15, 16, 17], id="prefill-block-pm1"),
        pytest.param([33, 16, 17], [2, 16, 1], id="chunked-block-pm1"),
        pytest.param([1, 70, 5, 130, 48], [1, 30, 5, 1, 17], id="mixed"),
        pytest.param([40, 130, 17, 300, 9], [5, 2, 1, 4, 3], id="draft-verification"),
    ],
)
def test_lengths_match_naive(seq_lens, q_lens):
    case = make_case(
        seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, num_padding_tokens=3
    )
    assert_matches_naive(case, run_reference(case))


def test_decode_rows_split_into_bounded_chunks_match_naive(monkeypatch):
    """A gather budget of one request per chunk gives the same answer as one big chunk."""
    seq_lens = [40, 7, 130, 16]
    case = make_case(seq_lens, [1] * 4, num_heads=8, num_kv_heads=2, head_dim=64)
    kv_cache = case.kv_cache
    bytes_per_longest = max(seq_lens) * 2 * 64 * 4
    monkeypatch.setattr(torch_reference, "DECODE_GATHER_BYTES", bytes_per_longest)
    assert torch_reference._decode_chunks([0, 1, 2, 3], seq_lens, kv_cache) == [[2], [0], [3], [1]]
    assert_matches_naive(case, run_reference(case))


def test_decode_rows_of_similar_length_share_a_chunk():
    """Requests are padded to their chunk's longest, so lengths far apart go to separate
    chunks (longest first), and the answer is the same as the naive one."""
    seq_lens = [100, 9, 80, 120, 10, 95, 12]
    case = make_case(seq_lens, [1] * 7, num_heads=6, num_kv_heads=3, head_dim=64)
    chunks = torch_reference._decode_chunks(list(range(7)), seq_lens, case.kv_cache)
    assert chunks == [[3, 0, 5], [2], [6, 4, 1]]
    assert_matches_naive(case, run_reference(case))


@pytest.mark.parametrize("group_size", [1, 3, 4, 7, 8])
def test_gqa_groups_match_naive(group_size):
    case = make_case(
        [9, 40, 23],
        [1, 12, 23],
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=64,
        seed=group_size,
    )
    assert_matches_naive(case, run_reference(case))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims_match_naive(head_dim):
    case = make_case(
        [20, 37], [20, 1], num_heads=4, num_kv_heads=2, head_dim=head_dim, seed=head_dim
    )
    assert_matches_naive(case, run_reference(case))


@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_block_sizes_match_naive(block_size):
    seq_lens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    case = make_case(seq_lens, [1, 4, block_size + 1, 7], 6, 3, 64, block_size=block_size)
    assert_matches_naive(case, run_reference(case))


def test_bfloat16_cache_stays_close_to_naive():
    case = make_case([30, 9], [10, 1], 4, 1, 64, dtype=torch.bfloat16)
    out = run_reference(case)
    assert out.dtype == torch.bfloat16
    assert_matches_naive(case, out, atol=2e-2)


def test_poisoned_cache_slots_never_leak():
    """Every slot the batch does not own is NaN, including block-table padding (block 0)."""
    case = make_case([3, 17], [1, 2], 4, 2, 64, poison=True, num_padding_tokens=2)
    out = run_reference(case)
    assert torch.isnan(case.kv_cache).any(), "the case must really be poisoned"
    assert not torch.isnan(out[: case.num_real_tokens]).any()


@pytest.mark.parametrize("backend", [torch_reference, cpu_backend])
def test_empty_batch_returns_empty_output(backend):
    case = make_case([], [], 4, 2, 64)
    out = backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert out.shape == (0, 4, 64)


def test_requests_with_no_query_tokens_are_skipped():
    case = make_case([5, 9], [0, 3], 4, 2, 64)
    assert_matches_naive(case, run_reference(case))


@pytest.mark.parametrize("backend", [torch_reference, cpu_backend])
def test_out_argument_is_filled_and_returned(backend):
    case = make_case([12, 4], [3, 1], 4, 2, 64)
    out = torch.zeros_like(case.query)
    backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    returned = backend.paged_attention(
        case.query, case.kv_cache, case.metadata, case.scale, out=out
    )
    assert returned is out
    assert_matches_naive(case, out)


def test_cache_write_is_bit_exact_and_skips_negative_slots():
    case = make_case([20, 5], [6, 5], 4, 2, 64, dtype=torch.bfloat16, num_padding_tokens=4)
    before = case.kv_cache.clone()
    torch_reference.reshape_and_cache(
        case.key, case.value, case.kv_cache, case.metadata.slot_mapping
    )
    flat_after = case.kv_cache.view(2, -1, 2, 64).view(torch.int16)
    flat_before = before.view(2, -1, 2, 64).view(torch.int16)
    slots = case.metadata.slot_mapping
    written = slots[slots >= 0]
    assert torch.equal(flat_after[0, written], case.key[slots >= 0].view(torch.int16))
    assert torch.equal(flat_after[1, written], case.value[slots >= 0].view(torch.int16))
    untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])


def test_cache_write_converts_to_cache_dtype():
    case = make_case([4], [4], 2, 1, 64, dtype=torch.bfloat16)
    key32, value32 = case.key.float() + 1e-3, case.value.float()
    torch_reference.reshape_and_cache(key32, value32, case.kv_cache, case.metadata.slot_mapping)
    flat = case.kv_cache.view(2, -1, 1, 64)
    assert torch.equal(flat[0, case.metadata.slot_mapping], key32.to(torch.bfloat16))


def test_write_kv_and_attend_on_cpu_matches_naive():
    case = make_case([26, 1, 50], [26, 1, 3], 6, 2, 64, num_padding_tokens=1)
    out = write_kv_and_attend(
        case.query, case.key, case.value, case.kv_cache, case.metadata, case.scale
    )
    assert_matches_naive(case, out)
    expected_cache = make_case([26, 1, 50], [26, 1, 3], 6, 2, 64, num_padding_tokens=1)
    write_new_tokens(expected_cache)
    torch.testing.assert_close(
        case.kv_cache, expected_cache.kv_cache, equal_nan=True, atol=0, rtol=0
    )


def test_select_backend_sends_cpu_to_the_cpu_backend():
    """cpu_backend itself runs this reference when its C kernel cannot be built."""
    assert select_backend(torch.device("cpu")) is cpu_backend
    assert select_backend(torch.device("meta")) is torch_reference


def test_select_backend_uses_reference_for_cuda_without_cupy(monkeypatch):
    monkeypatch.setattr(cuda_backend, "is_available", lambda: False)
    assert select_backend(torch.device("cuda")) is torch_reference


def test_select_backend_picks_cuda_kernels_when_available(monkeypatch):
    monkeypatch.setattr(cuda_backend, "is_available", lambda: True)
    assert select_backend(torch.device("cuda")) is cuda_backend
    assert select_backend(torch.device("cpu")) is cpu_backend


def test_a_step_chooses_its_backend_and_plan_once_for_all_its_layers(monkeypatch):
    chosen_for = []

    def counting_select_backend(device):
        chosen_for.append(device)
        return torch_reference

    monkeypatch.setattr(attention, "select_backend", counting_select_backend)
    case = make_case([26, 1, 50], [26, 1, 3], 6, 2, 64)
    outputs = [
        write_kv_and_attend(
            case.query, case.key, case.value, case.kv_cache, case.metadata, case.scale
        )
        for _layer in range(3)
    ]
    assert chosen_for == [torch.device("cpu")]
    assert len(case.metadata.plans) == 2  # the backend and the torch reference's plan
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    next_step = make_case([26, 1, 50], [26, 1, 3], 6, 2, 64)
    write_kv_and_attend(
        next_step.query, next_step.key, next_step.value, next_step.kv_cache,
        next_step.metadata, next_step.scale,
    )  # fmt: skip
    assert chosen_for == [torch.device("cpu")] * 2


def test_attention_metadata_fields_cannot_change_during_a_step():
    metadata = make_case([4], [4], 2, 1, 64).metadata
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.max_seq_len = 5


def test_cuda_backend_is_unavailable_without_a_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert cuda_backend.is_available() is False
