"""The prefill attention kernel (long queries over a float32 paged cache, AVX2) against naive
attention in float64, through the CPU backend that routes long queries to it.

Same cases as the decode kernel's (tests/helpers/paged_attention_cases.py: blocks scattered, unused
slots NaN), with long queries: whole prompts, chunks over a context, several tiles per request,
GQA groups, head sizes, block sizes, sliding windows with freed blocks, NaN in a visible key.
On a CPU whose default build does not hold the kernel (AVX-512), the AVX2 build is compiled
here with `-mno-avx512f` and tested instead; on a CPU without AVX2/FMA the tests skip, listed
at the end of the run as kernel tests this host skipped.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.kernels.cpu import backend as cpu_backend
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from tests.helpers.cpu_kernel_builds import AVX2, kernel_library, requires_cpu_flags
from tests.helpers.paged_attention_cases import drop_keys_before_window, make_case, naive_attention

pytestmark = requires_cpu_flags(*AVX2.cpu_flags, kernel="prefill_attention.c")
ATOL = 1e-5


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return kernel_library(AVX2, tmp_path_factory)


@pytest.fixture
def kernel(library, monkeypatch):
    """The CPU backend running on the library under test."""
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    return library


def routing_of(case) -> cpu_backend._Routing:
    """How the backend routes this case on the library under test."""
    _, _, block_size, num_kv_heads, head_dim = case.kv_cache.shape
    capabilities = cpu_backend.attention_capabilities(
        cpu_kernel_loader.load(), case.query.shape[1], num_kv_heads, head_dim, block_size
    )
    return cpu_backend._routing(capabilities, case.query.dtype, case.kv_cache.dtype)


def run(case, sliding_window=None) -> torch.Tensor:
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    return cpu_backend.paged_attention(
        case.query, case.kv_cache, case.metadata, case.scale, sliding_window=sliding_window
    )


def assert_matches_naive(case, out: torch.Tensor) -> None:
    real = out[: case.num_real_tokens]
    assert not torch.isnan(real).any(), "NaN leaked from unused cache slots"
    torch.testing.assert_close(real.double(), naive_attention(case), atol=ATOL, rtol=0)


def prefill_items(case) -> list[int]:
    """The items the backend gives the prefill kernel for this case."""
    routing = routing_of(case)
    assert routing.takes_prefill
    plan = cpu_backend._build_plan(case.metadata, case.kv_cache.shape[2], routing)
    assert plan.long_requests == []
    return plan.prefill_requests.tolist()


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([130], [17], id="shortest-prefill"),
        pytest.param([100, 64, 33], [100, 64, 33], id="whole-prompts"),
        pytest.param([300, 90], [37, 90], id="chunk-over-context"),
        pytest.param([700], [650], id="many-tiles-and-key-passes"),
        pytest.param([40, 1, 250, 9, 130], [40, 1, 100, 3, 17], id="mixed-with-decodes"),
    ],
)
def test_long_queries_match_naive(kernel, seq_lens, q_lens):
    case = make_case(seq_lens, q_lens, 9, 3, 64, seed=len(seq_lens), num_padding_tokens=2)
    items = prefill_items(case)
    expected = [
        q > 16 and q * s >= cpu_backend.PREFILL_KERNEL_MIN_PAIRS
        for q, s in zip(q_lens, seq_lens, strict=True)
    ]
    assert items and len(items) == sum(expected)
    assert_matches_naive(case, run(case))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8, 32, 100])
def test_gqa_groups_match_naive(kernel, group):
    """Groups that fill an item with few tokens (32: 3 tokens; 100: one token, more rows than
    an item aims for)."""
    case = make_case([70, 45], [70, 20], 2 * group, 2, 32, seed=group)
    assert prefill_items(case)
    assert_matches_naive(case, run(case))


@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 256])
def test_head_dims_match_naive(kernel, head_dim):
    case = make_case([90, 41], [90, 30], 6, 2, head_dim, seed=head_dim)
    assert prefill_items(case)
    assert_matches_naive(case, run(case))


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 48, 64])
def test_block_sizes_match_naive(kernel, block_size):
    case = make_case([130, 77], [60, 77], 9, 3, 64, block_size=block_size, seed=block_size)
    assert prefill_items(case)
    assert_matches_naive(case, run(case))


@pytest.mark.parametrize("head_dim", [8, 24, 72, 320])
def test_head_sizes_it_cannot_take_go_elsewhere(kernel, head_dim):
    """Not a multiple of 16, or above 256: the backend keeps its other paths, still exact."""
    case = make_case([50], [50], 4, 2, head_dim, seed=head_dim)
    assert kernel.prefill_attention_tile_tokens(2, head_dim) == 0
    assert not routing_of(case).takes_prefill
    assert_matches_naive(case, run(case))


@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "window"),
    [
        pytest.param([200], [200], 50, id="prompt-longer-than-window"),
        pytest.param([400, 100], [120, 100], 64, id="chunk-window-straddles-blocks"),
        pytest.param([90], [40], 1, id="window-of-one"),
        pytest.param([150], [150], 1000, id="window-wider-than-context"),
    ],
)
def test_sliding_windows_with_freed_blocks_match_naive(kernel, seq_lens, q_lens, window):
    """Keys before a row's window get weight 0 and keys before every row's window (NaN-filled
    freed blocks, block 0) are never read."""
    case = make_case(seq_lens, q_lens, 8, 2, 64, seed=window, sliding_window=window)
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    drop_keys_before_window(case)
    assert prefill_items(case)
    out = cpu_backend.paged_attention(
        case.query, case.kv_cache, case.metadata, case.scale, sliding_window=window
    )
    assert_matches_naive(case, out)


def test_nan_in_a_visible_key_reaches_the_output(kernel):
    """Weight 0 for unseen keys is a select, not a product: a NaN that rows really attend to
    is not hidden, and rows before it stay clean."""
    case = make_case([60], [60], 4, 2, 64, poison=False)
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    block = int(case.metadata.block_table[0, 2])
    case.kv_cache[0, block, 5] = float("nan")  # key 37, both KV heads
    out = cpu_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert torch.isnan(out[37:60]).all()
    assert not torch.isnan(out[:37]).any()


def test_threads_give_the_same_answer(kernel):
    case = make_case([260, 130, 40], [200, 130, 25], 9, 3, 64, seed=7)
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    outputs = []
    previous = torch.get_num_threads()
    for num_threads in (1, 2, 3):
        torch.set_num_threads(num_threads)
        try:
            outputs.append(
                cpu_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
            )
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    assert_matches_naive(case, outputs[0])
