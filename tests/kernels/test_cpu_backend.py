"""The CPU backend (C kernel for short queries, SDPA for long ones) against naive attention.

Same cases as the torch reference's tests (lengths around block edges, mixed batches, GQA
groups, head sizes, block sizes, NaN-poisoned unused slots), plus what is the backend's own:
each kind of CPU's build of the kernel, OpenMP threads, the build cache and the fallbacks.
Which request goes to which path is tested for every build on any host in
test_cpu_attention_routing.py; here the kernels run, each where this CPU can run it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import re
import shutil

import pytest
import torch

from core_engine.kernels import select_backend, torch_reference
from core_engine.kernels.cpu import attention_args
from core_engine.kernels.cpu import backend as cpu_backend
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.worker.cpu_features import host_cpu_flags
from tests.helpers.cpu_kernel_builds import (
    AVX512_BF16,
    KERNEL_BUILDS,
    kernel_library,
    requires_cpu_flags,
)
from tests.helpers.paged_attention_cases import make_case, naive_attention

ATOL_FP32 = 1e-5

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler on this machine: the CPU backend is the torch reference here",
)


def run_backend(case) -> torch.Tensor:
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    return cpu_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)


def assert_matches_naive(case, out: torch.Tensor, atol: float = ATOL_FP32) -> None:
    real = out[: case.num_real_tokens]
    assert not torch.isnan(real).any(), "NaN leaked from unused cache slots"
    torch.testing.assert_close(real.double(), naive_attention(case), atol=atol, rtol=0)


def capabilities_of(case, library=None) -> cpu_backend.CpuAttentionCapabilities:
    """What the library (default: the loaded one) does for this case's attention shape."""
    library = library or cpu_kernel_loader.load()
    _, _, block_size, num_kv_heads, head_dim = case.kv_cache.shape
    return cpu_backend.attention_capabilities(
        library, case.query.shape[1], num_kv_heads, head_dim, block_size
    )


def route_without_prefill_kernel(monkeypatch, query_limit: int) -> None:
    """Routes as a build whose decode kernel takes queries up to `query_limit` tokens and
    that has no prefill kernel (longer queries go to SDPA), whatever this CPU's build is."""
    routing = cpu_backend._Routing(query_limit, takes_prefill=False)
    monkeypatch.setattr(cpu_backend, "_routing", lambda *args: routing)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader with an empty build cache in tmp_path, forgotten again afterwards."""
    monkeypatch.setenv(cpu_kernel_loader.CACHE_ENV, str(tmp_path))
    cpu_kernel_loader.forget_loaded()
    yield tmp_path
    cpu_kernel_loader.forget_loaded()


def test_kernel_builds_where_a_compiler_exists():
    assert cpu_backend.is_available()
    assert select_backend(torch.device("cpu")) is cpu_backend


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([1], [1], id="context-1"),
        pytest.param([15, 16, 17], [1, 1, 1], id="decode-block-pm1"),
        pytest.param([15, 16, 17], [2, 3, 4], id="short-chunks-block-pm1"),
        pytest.param([33, 26, 17], [2, 20, 1], id="short-and-long"),
        pytest.param([1, 70, 5, 130, 48, 300], [1, 30, 5, 1, 17, 4], id="mixed"),
        pytest.param([40, 130, 17, 300, 9], [5, 2, 1, 4, 3], id="draft-verification"),
    ],
)
def test_lengths_match_naive(seq_lens, q_lens):
    case = make_case(
        seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, num_padding_tokens=3
    )
    assert_matches_naive(case, run_backend(case))


@pytest.mark.parametrize("group_size", [1, 3, 4, 7, 8])
def test_gqa_groups_match_naive(group_size):
    case = make_case(
        [9, 40, 23, 61],
        [1, 3, 23, 1],
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=64,
        seed=group_size,
    )
    assert_matches_naive(case, run_backend(case))


@pytest.mark.parametrize("group_size", [2, 3, 4, 7])
def test_gqa_group_rows_give_the_bits_of_separate_heads(group_size):
    """A KV head's query rows scored and summed together (each key and value loaded once for
    the group) give exactly what each row gives alone: the same case with every KV head
    repeated once per query head (no sharing) yields the same bits."""
    case = make_case(
        [9, 40, 23, 61], [1, 3, 2, 1], num_heads=2 * group_size, num_kv_heads=2, head_dim=64
    )
    grouped = run_backend(case)
    separate_cache = case.kv_cache.repeat_interleave(group_size, dim=3).contiguous()
    separate = cpu_backend.paged_attention(case.query, separate_cache, case.metadata, case.scale)
    real = case.num_real_tokens
    assert not torch.isnan(grouped[:real]).any()
    assert torch.equal(grouped[:real], separate[:real])


@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 256, 320])
def test_head_dims_match_naive(head_dim):
    """64 and 128 are compiled for their size, 96 and 256 not; 320 accumulates V in memory
    instead of registers; 40 is no multiple of AVX-512's 16 floats (the reference runs it
    there)."""
    case = make_case(
        [20, 37, 5], [20, 1, 2], num_heads=4, num_kv_heads=2, head_dim=head_dim, seed=head_dim
    )
    assert_matches_naive(case, run_backend(case))


@pytest.mark.parametrize("block_size", [1, 16, 32, 48])
def test_block_sizes_match_naive(block_size):
    seq_lens = [block_size - 1 or 1, block_size, block_size + 1, 3 * block_size + 5]
    case = make_case(seq_lens, [1, 1, 2, 4], 6, 3, 64, block_size=block_size)
    assert_matches_naive(case, run_backend(case))


def test_poisoned_cache_slots_never_leak():
    """Every slot the batch does not own is NaN, including block-table padding (block 0)."""
    case = make_case([3, 17, 40], [1, 2, 1], 4, 2, 64, poison=True, num_padding_tokens=2)
    out = run_backend(case)
    assert torch.isnan(case.kv_cache).any(), "the case must really be poisoned"
    assert not torch.isnan(out[: case.num_real_tokens]).any()


def test_long_context_decode_matches_naive():
    case = make_case([2049, 700], [1, 1], 9, 3, 64, seed=5)
    assert_matches_naive(case, run_backend(case))


def test_bf16_fast_path_shapes_are_the_kernels_own():
    library = cpu_kernel_loader.load()
    built = bool(library.paged_attention_bf16_fast_path(64, 16))
    assert built == ("avx512_bf16" in host_cpu_flags())
    assert not library.paged_attention_bf16_fast_path(48, 16)  # head_dim not a multiple of 32
    assert not library.paged_attention_bf16_fast_path(64, 8)  # block not a multiple of 16


def test_short_queries_on_the_kernel_and_long_ones_on_sdpa_match_naive(monkeypatch):
    """As where the prefill kernel does not run (AVX-512 or plain C builds, bf16 caches)."""
    route_without_prefill_kernel(monkeypatch, cpu_backend.SHORT_QUERY_MAX_TOKENS)
    case = make_case([10, 30, 40, 8], [1, 16, 17, 0], 4, 2, 64)
    assert_matches_naive(case, run_backend(case))


def test_kernel_alone_handles_queries_beyond_the_short_limit(monkeypatch):
    """The kernel is exact for any query length; the limit is a speed choice only."""
    route_without_prefill_kernel(monkeypatch, 10**6)
    case = make_case([160, 33, 17], [150, 9, 17], 6, 2, 64, seed=3)  # 150: three tiles
    assert_matches_naive(case, run_backend(case))


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([50, 7, 90, 33, 16], [1, 1, 2, 1, 4], id="requests-split-over-threads"),
        pytest.param([300], [3], id="one-request-its-kv-heads-split"),
    ],
)
def test_threads_give_the_same_answer(seq_lens, q_lens):
    case = make_case(seq_lens, q_lens, 8, 2, 64, seed=11, num_padding_tokens=2)
    one_thread = run_backend(case)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two_threads = cpu_backend.paged_attention(
            case.query, case.kv_cache, case.metadata, case.scale
        )
    finally:
        torch.set_num_threads(threads)
    real = case.num_real_tokens
    torch.testing.assert_close(two_threads[:real], one_thread[:real], atol=0, rtol=0)
    assert_matches_naive(case, two_threads)


def test_requests_with_no_query_tokens_are_skipped():
    case = make_case([5, 9, 4], [0, 1, 0], 4, 2, 64)
    assert_matches_naive(case, run_backend(case))


# bf16 outputs of magnitude up to ~4 are rounded to steps of 2^-6; the sums inside are float32.
ATOL_BF16 = 2e-2


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([15, 16, 17], [1, 1, 1], id="decode-block-pm1"),
        pytest.param([1, 70, 5, 130, 48, 300], [1, 30, 5, 1, 17, 4], id="mixed"),
        pytest.param([40, 130, 17, 300, 9], [5, 2, 1, 4, 3], id="draft-verification"),
    ],
)
def test_bfloat16_cache_runs_the_kernel_and_matches_naive(seq_lens, q_lens):
    case = make_case(seq_lens, q_lens, 8, 2, 64, dtype=torch.bfloat16, num_padding_tokens=2)
    assert cpu_backend._kernel_supports(capabilities_of(case), case.kv_cache)
    out = run_backend(case)
    assert out.dtype == torch.bfloat16
    assert_matches_naive(case, out, atol=ATOL_BF16)
    expected = torch_reference.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    real = slice(0, case.num_real_tokens)
    torch.testing.assert_close(out[real].float(), expected[real].float(), atol=ATOL_BF16, rtol=0)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"),
    [
        pytest.param(16, 64, 3, id="smollm2-shape"),
        pytest.param(32, 128, 4, id="block-32-dim-128"),
        pytest.param(48, 96, 1, id="block-48-dim-96"),
        pytest.param(16, 320, 2, id="dim-320-beyond-the-register-path"),
        pytest.param(8, 64, 2, id="block-8-no-fast-path"),
        pytest.param(16, 48, 2, id="dim-48-no-fast-path"),
    ],
)
def test_bfloat16_fast_path_shapes_match_naive(monkeypatch, block_size, head_dim, group):
    """Every query length through the kernel (decodes, chunks, whole prompts), keys ending
    at every offset of a 16-key group, NaN in every slot the batch does not own."""
    monkeypatch.setattr(cpu_backend, "SHORT_QUERY_MAX_TOKENS", 10**6)
    seq_lens = [1, 15, 16, 17, 31, 33, 100, 64]
    q_lens = [1, 1, 16, 3, 31, 1, 40, 64]
    case = make_case(
        seq_lens, q_lens, 2 * group, 2, head_dim, block_size, torch.bfloat16,
        num_padding_tokens=2, seed=block_size + head_dim,
    )  # fmt: skip
    out = run_backend(case)
    assert torch.isnan(case.kv_cache).any(), "the case must really be poisoned"
    assert_matches_naive(case, out, atol=ATOL_BF16)


@requires_cpu_flags(*AVX512_BF16.cpu_flags, kernel="bf16 fast path of paged_attention.c")
def test_bfloat16_fast_path_takes_every_query_in_tiles(monkeypatch, tmp_path_factory):
    """Prompts of several tiles, a prompt of one, a decode and a request without query
    tokens, all on the fast path (its plan: test_cpu_attention_routing.py)."""
    library = kernel_library(AVX512_BF16, tmp_path_factory)
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    tile = cpu_backend.QUERY_TILE_TOKENS
    case = make_case(
        [700, 2 * tile, 30, 9], [2 * tile + 5, tile, 1, 0], 6, 2, 64, dtype=torch.bfloat16
    )
    capabilities = capabilities_of(case, library)
    assert capabilities.bf16_fast_path
    routing = cpu_backend._routing(capabilities, torch.bfloat16, torch.bfloat16)
    assert routing == cpu_backend._Routing(cpu_backend.FAST_BF16_QUERY_MAX_TOKENS, False)
    assert_matches_naive(case, run_backend(case), atol=ATOL_BF16)


def test_float32_query_over_a_bfloat16_cache_is_not_rounded():
    """The fast path rounds queries to bf16, so it must only see queries that were bf16:
    a float32 query keeps its low bits, and the result matches naive attention in float32."""
    case = make_case([40, 17], [1, 5], 6, 2, 64, dtype=torch.bfloat16, seed=9)
    query32 = case.query.float() + 1e-3 * torch.randn(case.query.shape)
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    out = cpu_backend.paged_attention(query32, case.kv_cache, case.metadata, case.scale)
    assert out.dtype == torch.float32
    expected = torch_reference.paged_attention(query32, case.kv_cache, case.metadata, case.scale)
    real = slice(0, case.num_real_tokens)
    torch.testing.assert_close(out[real], expected[real], atol=ATOL_FP32, rtol=0)


def test_float16_cache_runs_the_reference():
    case = make_case([30, 9], [10, 1], 4, 1, 64, dtype=torch.float16)
    assert not cpu_backend._kernel_supports(capabilities_of(case), case.kv_cache)
    out = run_backend(case)
    expected = torch_reference.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert out.dtype == torch.float16
    assert torch.equal(out[: case.num_real_tokens], expected[: case.num_real_tokens])


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            build,
            id=build.name,
            marks=requires_cpu_flags(
                *build.cpu_flags, kernel=f"{build.name} build of paged_attention.c"
            ),
        )
        for build in KERNEL_BUILDS
    ],
)
def test_every_build_matches_naive(monkeypatch, tmp_path_factory, build):
    """Each kind of CPU's build that this CPU runs (the default one, or one compiled here
    narrower than it): float32 and bf16 caches, head sizes that are and are not a multiple of
    its vectors, decodes, short chunks and a prompt of two tiles, on whichever paths this
    build routes them to."""
    library = kernel_library(build, tmp_path_factory)
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    for head_dim, dtype in itertools.product((24, 64, 320), (torch.float32, torch.bfloat16)):
        case = make_case(
            [1, 17, 70, 33, 130], [1, 1, 5, 16, 100], 6, 2, head_dim, dtype=dtype, seed=head_dim
        )
        out = run_backend(case)
        assert capabilities_of(case).vector_floats == build.attention.vector_floats
        uses_kernel = cpu_backend._kernel_supports(capabilities_of(case), case.kv_cache)
        assert uses_kernel == (head_dim % build.attention.vector_floats == 0)
        assert_matches_naive(case, out, atol=ATOL_FP32 if dtype == torch.float32 else ATOL_BF16)


def test_nan_in_a_visible_key_reaches_the_output():
    """Unused slots never leak, but a NaN the request really attends to is not hidden."""
    case = make_case([20, 20], [1, 1], 4, 2, 64, poison=False)
    cpu_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    first_block = int(case.metadata.block_table[0, 0])
    case.kv_cache[0, first_block, 3] = float("nan")  # key 3 of request 0, every KV head
    out = cpu_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert torch.isnan(out[0]).all()
    assert not torch.isnan(out[1]).any()


@pytest.mark.slow
def test_build_is_cached_on_disk(fresh_loader):
    library = cpu_kernel_loader.load()
    assert library is not None
    (built,) = fresh_loader.glob(f"{cpu_kernel_loader.LIBRARY_NAME}-*.so")
    mtime = built.stat().st_mtime_ns
    cpu_kernel_loader.forget_loaded()
    assert cpu_kernel_loader.load() is not None
    assert [p.name for p in fresh_loader.iterdir()] == [built.name], "no leftover staging files"
    assert built.stat().st_mtime_ns == mtime, "a cached build must not be recompiled"


def test_the_build_key_covers_every_header_the_sources_include():
    """A header left out of HEADERS would not change the cache key: an edit to it would keep
    serving the library built before the edit."""
    included = set()
    for path in (*cpu_kernel_loader.SOURCES, *cpu_kernel_loader.HEADERS):
        included |= set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE))
    assert included, "the sources include no header of their own"
    assert included == {path.name for path in cpu_kernel_loader.HEADERS}


def test_failed_build_falls_back_to_the_reference(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    with caplog.at_level(logging.WARNING, logger=cpu_kernel_loader.__name__):
        assert cpu_kernel_loader.load() is None
    assert "torch reference" in caplog.text
    assert list(fresh_loader.iterdir()) == [], "a failed build leaves nothing behind"
    case = make_case([20, 6], [1, 6], 4, 2, 64)
    assert_matches_naive(case, run_backend(case))


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv(cpu_kernel_loader.DISABLE_ENV, "0")
    assert cpu_kernel_loader.load() is None
    assert not cpu_backend.is_available()
    assert not os.listdir(fresh_loader)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_in_c_is_bit_exact_and_skips_negative_slots(dtype):
    """K and V as views of one fused qkv row; the same cache bytes as the torch reference."""
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 7, 3, 64, 5, 16
    qkv = torch.randn(num_tokens, (6 + 2 * num_kv_heads) * head_dim).to(dtype)
    k_start, v_start = 6 * head_dim, (6 + num_kv_heads) * head_dim
    key = qkv[:, k_start:v_start].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, v_start:].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.tensor([3, -1, 17, 79, 0, -1, 40])
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = torch.full(shape, float("nan"), dtype=dtype)
    actual = expected.clone()
    torch_reference.reshape_and_cache(key, value, expected, slots)
    assert cpu_backend._writes_in_c(key, value, actual, slots)
    cpu_backend.reshape_and_cache(key, value, actual, slots)
    assert torch.equal(actual.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    assert int(torch.isnan(actual).sum()) == actual.numel() - 2 * 5 * num_kv_heads * head_dim


def test_cache_write_of_another_dtype_goes_through_torch():
    key = value = torch.randn(2, 1, 16)
    cache = torch.zeros(2, 1, 16, 1, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5])
    assert not cpu_backend._writes_in_c(key, value, cache, slots)
    cpu_backend.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache[0, 0, 5], key[1].bfloat16())


def test_the_attention_args_struct_has_the_c_layout():
    library = cpu_kernel_loader.load()
    if library is None:
        pytest.skip("no C compiler: the CPU kernels are not built on this machine")
    size, offsets = attention_args.compiled_layout(library)
    assert (size, offsets) == attention_args.python_layout()
    assert len(set(offsets)) == len(attention_args.FIELDS)  # every field reported, in order
    assert offsets == sorted(offsets) and size >= offsets[-1] + 4


def test_a_struct_out_of_step_with_the_c_header_is_caught():
    library = cpu_kernel_loader.load()
    if library is None:
        pytest.skip("no C compiler: the CPU kernels are not built on this machine")
    fields = attention_args.FIELDS
    widened = [*fields[:9], ("num_requests", ctypes.c_int64), *fields[10:]]
    assert fields[9][0] == "num_requests"
    assert _layout(widened) != attention_args.compiled_layout(library)
    assert _layout(list(fields)) == attention_args.compiled_layout(library)


def _layout(fields: list) -> tuple[int, list[int]]:
    return attention_args.layout_of(type("Args", (ctypes.Structure,), {"_fields_": fields}))


@pytest.mark.parametrize(
    "routing", [cpu_backend._Routing(16, False), cpu_backend._Routing(512, True)]
)
def test_a_decode_steps_plan_is_the_general_plans(routing):
    """Every request one query token: the short cut builds the plan the general loop builds
    (which a metadata claiming longer queries still takes)."""
    case = make_case([40, 1, 17, 300], [1, 1, 1, 1], 4, 2, 16)
    metadata = case.metadata
    decode = cpu_backend._build_plan(metadata, 16, routing)
    general = cpu_backend._build_plan(dataclasses.replace(metadata, max_query_len=2), 16, routing)
    assert decode.max_query_x_seq_len == general.max_query_x_seq_len == 300
    assert decode.long_requests == general.long_requests == []
    for field in ("short_requests", "prefill_requests", "block_table", "seq_lens", "query_start"):
        mine, theirs = getattr(decode, field), getattr(general, field)
        assert mine.dtype == theirs.dtype == torch.int32 and torch.equal(mine, theirs), field
