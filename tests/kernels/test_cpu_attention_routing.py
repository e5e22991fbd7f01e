"""The CPU backend's routing and plans, for every kind of kernel build, on any host.

Which path takes a request (the decode kernel in tiles, the prefill kernel, SDPA) and the work
items the kernels see follow from the build's `CpuAttentionCapabilities`, the dtypes and the
step's metadata alone, so these tests give each build's capabilities (tests/helpers/cpu_kernel_builds.py)
and need neither its instructions nor a compiler. That each build reports those capabilities
is tested in test_cpu_kernel_builds.py; the kernels' numbers in test_cpu_backend.py and
test_cpu_prefill_attention.py.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from core_engine.kernels.cpu import backend as cpu_backend
from tests.helpers.cpu_kernel_builds import (
    ATTENTION_SHAPE,
    AVX2,
    AVX512,
    AVX512_BF16,
    KERNEL_BUILDS,
    PLAIN_C,
)
from tests.helpers.paged_attention_cases import make_case

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = ATTENTION_SHAPE
# The AVX2 build at a head size its prefill kernel does not take (above 256, or no multiple of 16).
AVX2_WITHOUT_PREFILL = dataclasses.replace(AVX2.attention, prefill_tile_tokens=0)
F32, BF16 = torch.float32, torch.bfloat16
Routing = cpu_backend._Routing


@pytest.mark.parametrize(
    ("capabilities", "query_dtype", "cache_dtype", "expected"),
    [
        pytest.param(AVX2.attention, F32, F32, Routing(512, True), id="avx2-f32"),
        pytest.param(AVX2.attention, BF16, BF16, Routing(16, False), id="avx2-bf16"),
        pytest.param(AVX2_WITHOUT_PREFILL, F32, F32, Routing(512, False), id="avx2-f32-no-prefill"),
        pytest.param(AVX512.attention, F32, F32, Routing(16, False), id="avx512-f32"),
        pytest.param(AVX512.attention, BF16, BF16, Routing(16, False), id="avx512-bf16-cache"),
        pytest.param(
            AVX512_BF16.attention, BF16, BF16, Routing(sys.maxsize, False), id="fast-bf16"
        ),
        pytest.param(
            AVX512_BF16.attention, F32, BF16, Routing(16, False), id="fast-bf16-f32-query"
        ),
        pytest.param(AVX512_BF16.attention, F32, F32, Routing(16, False), id="fast-bf16-f32-cache"),
        pytest.param(PLAIN_C.attention, F32, F32, Routing(16, False), id="plain-c-f32"),
        pytest.param(PLAIN_C.attention, BF16, BF16, Routing(16, False), id="plain-c-bf16"),
    ],
)
def test_routing_follows_the_build_and_the_dtypes(capabilities, query_dtype, cache_dtype, expected):
    """The decode kernel's query limit: every query where the bf16 fast path runs (a bf16
    query over a bf16 cache), 512 tokens for AVX2 over a float32 cache, 16 elsewhere; the
    prefill kernel only over a float32 cache with a build and head size it takes."""
    assert expected.query_limit in (
        cpu_backend.SHORT_QUERY_MAX_TOKENS,
        cpu_backend.AVX2_FLOAT32_QUERY_MAX_TOKENS,
        cpu_backend.FAST_BF16_QUERY_MAX_TOKENS,
    )
    assert cpu_backend._routing(capabilities, query_dtype, cache_dtype) == expected


# One step of every kind of request (GQA group 3, head size 64, blocks of 16): (seq_len, q_len)
STEP = [
    (10, 1),  # 0: a decode
    (30, 30),  # 1: a short prompt, 900 (token, key) pairs: too little for the prefill kernel
    (200, 17),  # 2: a chunk of 17 over 200 keys, 3,400 pairs
    (600, 600),  # 3: a prompt above AVX2's 512-token limit
    (130, 16),  # 4: 16 tokens, the longest short query
    (9, 0),  # 5: no query tokens
    (100, 100),  # 6: a prompt of two decode-kernel tiles
]
STARTS = [0, 1, 31, 48, 648, 664, 664, 764]  # query_start_loc of STEP
SEQ_LENS = [seq_len for seq_len, _ in STEP]
TILES_OF_3 = [(48 + 64 * t, 64 * (t + 1)) for t in range(9)] + [(624, 600)]


@dataclasses.dataclass(frozen=True)
class ExpectedPlan:
    items: list[tuple[int, int, int]]  # (request, query start, seq_len) of every item
    short_items: list[int]  # for the decode kernel
    prefill_items: list[int]  # for the prefill kernel
    sdpa_requests: list[int]  # for SDPA
    max_query_x_seq_len: int


WHOLE_REQUESTS = [(r, STARTS[r], SEQ_LENS[r]) for r in range(len(STEP))]
AVX2_PLAN = ExpectedPlan(WHOLE_REQUESTS, [0, 1, 4], [2, 3, 6], [], 16 * 130)
SHORT_PLAN = ExpectedPlan(WHOLE_REQUESTS, [0, 4], [], [1, 2, 3, 6], 16 * 130)
AVX2_WITHOUT_PREFILL_PLAN = ExpectedPlan(
    [*WHOLE_REQUESTS[:6], (6, 664, 64), (6, 728, 100)], [0, 1, 2, 4, 6, 7], [], [3], 64 * 64
)
FAST_BF16_PLAN = ExpectedPlan(
    [*WHOLE_REQUESTS[:3], *[(3, s, n) for s, n in TILES_OF_3], *WHOLE_REQUESTS[4:6]]
    + [(6, 664, 64), (6, 728, 100)],
    [*range(14), 15, 16],  # item 14 is request 5's: no query tokens, no work
    [],
    [],
    64 * 576,
)


@pytest.mark.parametrize(
    ("capabilities", "dtype", "expected"),
    [
        pytest.param(AVX2.attention, F32, AVX2_PLAN, id="avx2-f32"),
        pytest.param(AVX2_WITHOUT_PREFILL, F32, AVX2_WITHOUT_PREFILL_PLAN, id="avx2-no-prefill"),
        pytest.param(AVX2.attention, BF16, SHORT_PLAN, id="avx2-bf16"),
        pytest.param(AVX512.attention, F32, SHORT_PLAN, id="avx512-f32"),
        pytest.param(AVX512.attention, BF16, SHORT_PLAN, id="avx512-bf16-cache"),
        pytest.param(AVX512_BF16.attention, BF16, FAST_BF16_PLAN, id="fast-bf16"),
        pytest.param(AVX512_BF16.attention, F32, SHORT_PLAN, id="fast-bf16-build-f32"),
        pytest.param(PLAIN_C.attention, F32, SHORT_PLAN, id="plain-c-f32"),
        pytest.param(PLAIN_C.attention, BF16, SHORT_PLAN, id="plain-c-bf16"),
    ],
)
def test_every_request_goes_where_the_build_runs_it_fastest(capabilities, dtype, expected):
    """AVX2, float32: the prefill kernel takes queries above 16 tokens over at least
    PREFILL_KERNEL_MIN_PAIRS pairs and every one above 512, the decode kernel the rest, SDPA
    none. The bf16 fast path: the decode kernel takes every query, in tiles of 64 (a tile's
    seq_len ends at its last token). Elsewhere: the decode kernel up to 16 tokens, SDPA above.
    A request without query tokens is an item no kernel runs."""
    seq_lens, q_lens = zip(*STEP, strict=True)
    case = make_case(list(seq_lens), list(q_lens), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    routing = cpu_backend._routing(capabilities, dtype, dtype)
    plan = cpu_backend._build_plan(case.metadata, BLOCK_SIZE, routing)
    rows = [request for request, _, _ in expected.items]
    assert plan.query_start.tolist() == [start for _, start, _ in expected.items] + [STARTS[-1]]
    assert plan.seq_lens.tolist() == [seq_len for _, _, seq_len in expected.items]
    assert torch.equal(plan.block_table, case.metadata.block_table[rows].to(torch.int32))
    assert plan.short_requests.tolist() == expected.short_items
    assert plan.prefill_requests.tolist() == expected.prefill_items
    assert [(r.q_start, r.q_end, r.seq_len) for r in plan.long_requests] == [
        (STARTS[r], STARTS[r + 1], SEQ_LENS[r]) for r in expected.sdpa_requests
    ]
    assert plan.max_query_x_seq_len == expected.max_query_x_seq_len
    for item in (plan.block_table, plan.seq_lens, plan.query_start, plan.short_requests):
        assert item.dtype == torch.int32 and item.is_contiguous()


@pytest.mark.parametrize("build", KERNEL_BUILDS, ids=lambda build: build.name)
def test_decode_kernel_takes_contiguous_caches_whose_head_size_fits_its_vectors(build):
    """Float32 and bf16 caches whose head size is a multiple of the vector width; a float16 or
    strided cache (which no one allocates) runs on the torch reference."""
    takes = {
        head_dim
        for head_dim in (20, 24, 40, 48, 64, 320)
        if cpu_backend._kernel_supports(build.attention, torch.zeros(2, 4, 16, 2, head_dim))
    }
    expected = {1: {20, 24, 40, 48, 64, 320}, 8: {24, 40, 48, 64, 320}, 16: {48, 64, 320}}
    assert takes == expected[build.attention.vector_floats]
    bf16 = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    assert cpu_backend._kernel_supports(build.attention, bf16)
    assert not cpu_backend._kernel_supports(build.attention, bf16.half())
    assert not cpu_backend._kernel_supports(
        build.attention, torch.zeros(2, 4, 16, 2, 128)[..., :64]
    )
