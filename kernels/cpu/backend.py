"""CPU backend: C kernels for short and long queries, the torch reference's SDPA elsewhere.

Same functions and contracts as `kernels/torch_reference.py`. Requests with at most
SHORT_QUERY_MAX_TOKENS query tokens (decodes, small chunks), more on AVX2 with a float32
cache, and every request where the kernel's bf16 fast path applies, go to
`paged_attention.c`, which reads K/V straight from the paged cache: no gather copy, no
padding to a chunk's longest request. Where `prefill_attention.c` is built (AVX2 without
AVX-512) and the cache is float32, longer queries go to it (flash-attention order on matmul
tiles, again straight from the paged cache); elsewhere they are matmul-bound and stay on
SDPA's fused kernel. The decode kernel reads float32 or bfloat16 caches (queries and sums in
float32), and its head size must be a multiple of its vector width; other caches run wholly on
the torch reference. Every path takes a sliding window (the kernels give keys before it
weight 0; SDPA masks them).

Which path takes a request is decided by pure functions of the tensors' dtypes and layout, the
step's metadata and a `CpuAttentionCapabilities`: what the loaded build does for one attention
shape, read from the library once per shape. Only the kernels themselves need the
instructions; the routing is the same code on every CPU, and its tests build the capabilities
of each kind of CPU."""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

import torch

from core_engine.kernels import torch_reference
from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.attention_args import attention_args

# Above this many query tokens (more than a decode or a small chunk) a request is faster
# through SDPA's blocked matmuls.
SHORT_QUERY_MAX_TOKENS = 16
# Where the kernel takes its bf16 fast path (bf16 model, AVX512_BF16) it takes every query:
# split into tiles it beat SDPA at every prompt length measured (benchmarks/results).
FAST_BF16_QUERY_MAX_TOKENS = sys.maxsize
# Where the kernel scores float32 keys 8 at a time (AVX2 builds), it beats SDPA on prompts up to
# this many tokens (it reads the paged cache in place and spreads tiles over threads), but not
# on long prompts over long contexts, where SDPA's blocked matmuls win.
AVX2_FLOAT32_QUERY_MAX_TOKENS = 512
# Query tokens of one kernel work item; longer requests are split (see _build_plan).
QUERY_TILE_TOKENS = 64
# Where the prefill kernel runs (a float32 cache on AVX2), it takes every query of more than
# SHORT_QUERY_MAX_TOKENS tokens over at least this many (query token, key) pairs, and every
# query above the decode kernel's limit: it was faster from there on (1.25-1.4x the decode
# kernel's tiles on 1,000-token prompts, 1.35x SDPA), while the tiles keep short prompts
# (8 x 32 tokens: 0.88x).
PREFILL_KERNEL_MIN_PAIRS = 2048


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`torch_reference.reshape_and_cache` in one C call (no mask, no conversions, no
    per-op dispatch) when key and value share the contiguous cache's dtype and each token's
    heads are contiguous, as views of a fused qkv projection are."""
    library = cpu_kernel_loader.load()
    if library is None or not _writes_in_c(key, value, kv_cache, slot_mapping):
        torch_reference.reshape_and_cache(key, value, kv_cache, slot_mapping)
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    element = kv_cache.element_size()
    library.reshape_and_cache(
        key.data_ptr(),
        key.stride(0) * element,
        value.data_ptr(),
        value.stride(0) * element,
        kv_cache.data_ptr(),
        num_blocks * block_size * num_kv_heads * head_dim * element,
        slot_mapping.data_ptr(),
        key.shape[0],
        num_kv_heads * head_dim * element,
    )


def _writes_in_c(key, value, kv_cache, slot_mapping) -> bool:
    head_dim = kv_cache.shape[4]
    return (
        key.dtype == value.dtype == kv_cache.dtype
        and kv_cache.is_cpu
        and key.is_cpu
        and value.is_cpu
        and kv_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and key.shape == value.shape
        and key.shape[1:] == kv_cache.shape[3:]
        and key.stride()[1:] == value.stride()[1:] == (head_dim, 1)
    )


def is_available() -> bool:
    """Whether the C kernel is built and loadable on this machine."""
    return cpu_kernel_loader.load() is not None


@dataclass(slots=True, frozen=True)
class CpuAttentionCapabilities:
    """What the kernel build does for one attention shape (query heads, KV heads, head size,
    block size): all that routing asks of the machine. `attention_capabilities` reads it from
    the library; tests build one per kind of CPU."""

    vector_floats: int  # the decode kernel's vector width: 16 (AVX-512), 8 (AVX2), 1 (plain C)
    bf16_fast_path: bool  # a bf16 model's attention takes the bf16 fast path (AVX512_BF16)
    prefill_tile_tokens: int  # the prefill kernel's query tokens per item; 0: no prefill kernel


@functools.cache
def attention_capabilities(
    library: ctypes.CDLL, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> CpuAttentionCapabilities:
    """What `library` does for this shape, asked once per library and shape instead of at
    every layer."""
    group = num_q_heads // num_kv_heads if num_q_heads % num_kv_heads == 0 else 0
    return CpuAttentionCapabilities(
        vector_floats=library.paged_attention_vector_floats(),
        bf16_fast_path=bool(library.paged_attention_bf16_fast_path(head_dim, block_size)),
        prefill_tile_tokens=library.prefill_attention_tile_tokens(group, head_dim),
    )


@dataclass(slots=True, frozen=True)
class _Routing:
    """Which path attends a request: the decode kernel (in tiles) up to `query_limit` query
    tokens; a longer one the prefill kernel where `takes_prefill`, else SDPA; with
    `takes_prefill`, also a shorter one that `_suits_prefill_kernel`."""

    query_limit: int
    takes_prefill: bool


@dataclass(slots=True, frozen=True)
class _CpuPlan:
    """One step's split (short requests for the kernel, long ones for the prefill kernel or
    SDPA) and the int32 contiguous metadata the kernels read, built once for all layers."""

    short_requests: torch.Tensor  # int32 [S]: item indices for paged_attention.c
    max_query_x_seq_len: int  # max over the short requests of q_len * seq_len
    prefill_requests: torch.Tensor  # int32 [P]: item indices for prefill_attention.c
    long_requests: list[torch_reference.PrefillRequest]  # for SDPA
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start: torch.Tensor  # int32 [B + 1]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, H_q, D] over the paged cache, bottom-right causal (and
    within `sliding_window`, when given: see `torch_reference.paged_attention`)."""
    library = cpu_kernel_loader.load()
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    capabilities = None
    if library is not None:
        capabilities = attention_capabilities(
            library, query.shape[1], num_kv_heads, head_dim, block_size
        )
    if capabilities is None or not _kernel_supports(capabilities, kv_cache):
        return torch_reference.paged_attention(
            query, kv_cache, metadata, scale, out, sliding_window=sliding_window
        )
    dtype = query.dtype
    result = torch.empty(query.shape, dtype=torch.float32)
    query = query.float().contiguous()
    routing = _routing(capabilities, dtype, kv_cache.dtype)
    plan = metadata.plans.get(
        ("cpu", block_size, routing), lambda: _build_plan(metadata, block_size, routing)
    )
    for request in plan.long_requests:
        torch_reference.prefill_attention(query, kv_cache, scale, result, request, sliding_window)
    if len(plan.prefill_requests):
        _run_prefill_kernel(library, query, kv_cache, scale, sliding_window, plan, result)
    if len(plan.short_requests):
        _run_kernel(
            library, query, dtype == torch.bfloat16, kv_cache, scale, sliding_window, plan, result
        )
    if out is None:
        return result.to(dtype)
    return out.copy_(result)


@dataclass(slots=True, frozen=True)
class DecodeKernelRoute:
    """How `paged_attention` routes float32 queries over one KV cache (shape and dtype): what
    `decode_kernel_plan` needs besides the step. Holds while the cache does."""

    block_size: int
    routing: _Routing


def decode_kernel_route(num_q_heads: int, kv_cache: torch.Tensor) -> DecodeKernelRoute | None:
    """The route of float32 queries over `kv_cache`, or None when the kernels are not loaded
    or do not take the cache."""
    library = cpu_kernel_loader.load()
    if library is None:
        return None
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    capabilities = attention_capabilities(library, num_q_heads, num_kv_heads, head_dim, block_size)
    if not _kernel_supports(capabilities, kv_cache):
        return None
    return DecodeKernelRoute(block_size, _routing(capabilities, torch.float32, kv_cache.dtype))


def decode_kernel_plan(metadata: AttentionMetadata, route: DecodeKernelRoute) -> _CpuPlan | None:
    """The step's plan (the one `paged_attention` builds and shares) when the decode kernel
    attends every request of the step over a cache of `route`, as in a decode step; None when
    any request goes elsewhere (the prefill kernel, SDPA)."""
    block_size, routing = route.block_size, route.routing
    plan = metadata.plans.get(
        ("cpu", block_size, routing), lambda: _build_plan(metadata, block_size, routing)
    )
    return None if len(plan.prefill_requests) or plan.long_requests else plan


def _kernel_supports(capabilities: CpuAttentionCapabilities, kv_cache: torch.Tensor) -> bool:
    """Contiguous float32 or bfloat16 CPU caches whose head size is a multiple of the
    kernel's vector width (16 floats with AVX-512)."""
    head_dim = kv_cache.shape[4]
    return (
        kv_cache.dtype in (torch.float32, torch.bfloat16)
        and kv_cache.is_cpu
        and kv_cache.is_contiguous()
        and head_dim % capabilities.vector_floats == 0
    )


def _routing(
    capabilities: CpuAttentionCapabilities, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> _Routing:
    """The decode kernel's longest query (longer ones go to the prefill kernel or SDPA; see
    the limits above) and whether the prefill kernel runs: a float32 cache and a build and
    shape it takes (AVX2 without AVX-512)."""
    if query_dtype == cache_dtype == torch.bfloat16 and capabilities.bf16_fast_path:
        query_limit = FAST_BF16_QUERY_MAX_TOKENS
    elif capabilities.vector_floats == 8 and cache_dtype == torch.float32:
        query_limit = AVX2_FLOAT32_QUERY_MAX_TOKENS
    else:
        query_limit = SHORT_QUERY_MAX_TOKENS
    takes_prefill = cache_dtype == torch.float32 and capabilities.prefill_tile_tokens > 0
    return _Routing(query_limit, takes_prefill)


def _suits_prefill_kernel(q_len: int, seq_len: int) -> bool:
    """Whether a query the decode kernel could take is faster on the prefill kernel."""
    return q_len > SHORT_QUERY_MAX_TOKENS and q_len * seq_len >= PREFILL_KERNEL_MIN_PAIRS


def _run_kernel(
    library: ctypes.CDLL,
    query: torch.Tensor,
    query_is_bf16: bool,
    kv_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    plan: _CpuPlan,
    result: torch.Tensor,
) -> None:
    """Fills the short requests' rows of `result`; query and result are contiguous float32
    (`query_is_bf16`: the query was bf16 before it was widened, so the kernel may round it back
    to bf16 exactly and take its bf16 fast path over a bf16 cache)."""
    scratch_floats = plan.max_query_x_seq_len * query.shape[1]
    args = attention_args(
        query, kv_cache, plan.block_table, plan.seq_lens, plan.query_start,
        plan.short_requests, result, scale, sliding_window, query_is_bf16,
    )  # fmt: skip
    status = library.paged_attention(ctypes.byref(args), scratch_floats)
    if status != 0:
        raise MemoryError(f"CPU attention could not allocate {scratch_floats * 4} bytes of scores")


def _run_prefill_kernel(
    library: ctypes.CDLL,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    plan: _CpuPlan,
    result: torch.Tensor,
) -> None:
    """Fills the prefill requests' rows of `result` (query and result contiguous float32)."""
    args = attention_args(
        query, kv_cache, plan.block_table, plan.seq_lens, plan.query_start,
        plan.prefill_requests, result, scale, sliding_window,
    )  # fmt: skip
    status = library.prefill_attention(ctypes.byref(args))
    if status != 0:
        raise MemoryError("CPU prefill attention could not allocate its panels")


def _build_plan(metadata: AttentionMetadata, block_size: int, routing: _Routing) -> _CpuPlan:
    """The kernel sees work items, not requests: a request of more than QUERY_TILE_TOKENS
    query tokens becomes one item per tile of them (its seq_len cut at the tile's last token,
    so causality is unchanged), which bounds each thread's score rows to a tile's and spreads
    one long prompt over every thread. Items cover the step's tokens in order, so one
    query_start array serves them all. A request `routing` does not give the decode kernel
    gets one item that the prefill kernel runs or that no kernel runs (SDPA takes it)."""
    if metadata.max_query_len == 1 and metadata.slot_mapping.shape[0] == metadata.num_reqs:
        return _decode_plan(metadata)
    query_limit, takes_prefill = routing.query_limit, routing.takes_prefill
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    item_rows, item_starts, item_seq_lens, kernel_items, prefill_items = [], [], [], [], []
    long_requests, max_query_x_seq_len = [], 0
    block_table = None
    for row, seq_len in enumerate(seq_lens):
        q_start, q_len = starts[row], starts[row + 1] - starts[row]
        if q_len > query_limit or (takes_prefill and _suits_prefill_kernel(q_len, seq_len)):
            if takes_prefill:
                prefill_items.append(len(item_rows))
            else:
                if block_table is None:
                    block_table = metadata.block_table.long()
                long_requests.append(
                    torch_reference.prefill_request(row, starts, seq_len, block_table, block_size)
                )
            item_rows.append(row), item_starts.append(q_start), item_seq_lens.append(seq_len)
            continue
        context = seq_len - q_len
        for tile_start in range(0, max(q_len, 1), QUERY_TILE_TOKENS):
            tile_end = min(tile_start + QUERY_TILE_TOKENS, q_len)
            if tile_end > tile_start:
                kernel_items.append(len(item_rows))
                tile_seq_len = context + tile_end
                max_query_x_seq_len = max(
                    max_query_x_seq_len, (tile_end - tile_start) * tile_seq_len
                )
            item_rows.append(row)
            item_starts.append(q_start + tile_start)
            item_seq_lens.append(context + tile_end)
    item_starts.append(starts[-1])
    rows = torch.tensor(item_rows, dtype=torch.long)
    return _CpuPlan(
        short_requests=torch.tensor(kernel_items, dtype=torch.int32),
        max_query_x_seq_len=max_query_x_seq_len,
        prefill_requests=torch.tensor(prefill_items, dtype=torch.int32),
        long_requests=long_requests,
        block_table=metadata.block_table.index_select(0, rows).to(torch.int32).contiguous(),
        seq_lens=torch.tensor(item_seq_lens, dtype=torch.int32),
        query_start=torch.tensor(item_starts, dtype=torch.int32),
    )


def _decode_plan(metadata: AttentionMetadata) -> _CpuPlan:
    """`_build_plan` of a step where every request runs one query token (a decode step): one
    item per request, all the decode kernel's, the metadata's own int32 tensors as they are
    (every route takes a one-token query), without the general plan's Python loop or a new
    tensor (a decode step's plan is built on the host's critical path)."""
    return _CpuPlan(
        short_requests=_request_indices(metadata.num_reqs),
        max_query_x_seq_len=metadata.max_seq_len,
        prefill_requests=_NO_REQUESTS,
        long_requests=[],
        block_table=_int32_contiguous(metadata.block_table),
        seq_lens=_int32_contiguous(metadata.seq_lens),
        query_start=_int32_contiguous(metadata.query_start_loc),
    )


_NO_REQUESTS = torch.empty(0, dtype=torch.int32)
_REQUEST_INDICES: dict[int, torch.Tensor] = {}


def _request_indices(num_reqs: int) -> torch.Tensor:
    """int32 0 .. num_reqs - 1, kept per count (read-only: the kernels never write it)."""
    indices = _REQUEST_INDICES.get(num_reqs)
    if indices is None:
        indices = _REQUEST_INDICES[num_reqs] = torch.arange(num_reqs, dtype=torch.int32)
    return indices


def _int32_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.int32 and tensor.is_contiguous():
        return tensor
    return tensor.to(torch.int32).contiguous()
