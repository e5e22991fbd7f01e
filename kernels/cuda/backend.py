"""CUDA backend: the kernels in `kernels/cuda/*.cu`, compiled by NVRTC and launched through CuPy.

Same functions and signatures as `kernels/torch_reference.py`. Contracts:
- Every launch goes to torch's current stream, read at each call, so kernels order with torch
  ops and can be captured in CUDA graphs. Launchers never synchronize with the host, allocate
  only through torch (split-KV scratch), and never launch an empty grid.
- Kernels run in the cache dtype (float32, float16 or bfloat16) with fp32 math; query/key/value
  of another dtype are converted first, and so is the output on the way back.
- head_dim must be a multiple of 8, at most 256; block_size may be any positive value.
- `metadata.max_query_len` / `max_seq_len` must bound the device-side values (they size grids):
  decode splits cover at most min(`max_seq_len`, `sliding_window`) keys.
- With `sliding_window` W the query at position p attends to keys p - W + 1 .. p, and no kernel
  reads a key before the window of the request's first query token: their blocks may have been
  freed (the null block 0 in the block table), their slots may hold anything, NaN included.
CuPy is imported lazily, so this module imports (and `is_available()` answers False) without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core_engine.common.dtypes import DTYPE_NAMES, dtype_name
from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda import occupancy
from core_engine.kernels.cuda.module_loader import default_loader

LOG2E = 1.4426950408889634


@functools.cache
def is_available() -> bool:
    """True when torch sees a CUDA device and CuPy imports and sees one too."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, H_kv, D] into kv_cache [2, N, block_size, H_kv, D] at slot_mapping.

    Tokens whose slot is negative are skipped; every other slot is overwritten exactly
    (bit-exact when key/value already have the cache dtype).
    """
    num_tokens = int(key.shape[0])
    if num_tokens == 0:
        return
    _check_cache(kv_cache)
    key = _as_rows(key, kv_cache.dtype)
    value = _as_rows(value, kv_cache.dtype)
    slot_mapping = _as_index(slot_mapping, torch.int64)
    element_bytes = kv_cache.element_size()
    row_bytes = int(kv_cache.shape[3]) * int(kv_cache.shape[4]) * element_bytes
    launch = lc.cache_write_launch(num_tokens, row_bytes)
    device = kv_cache.device
    kernel = default_loader().get_kernel(
        "reshape_and_cache.cu", lc.CACHE_WRITE_KERNEL_NAME, device.index
    )
    args = (
        _ptr(key),
        _ptr(value),
        _ptr(kv_cache[0]),
        _ptr(kv_cache[1]),
        _ptr(slot_mapping),
        np.int64(key.stride(0) * element_bytes // lc.VECTOR_BYTES),
        np.int64(value.stride(0) * element_bytes // lc.VECTOR_BYTES),
        np.int32(launch.row_vecs),
    )
    _launch(kernel, launch.grid, launch.block, args, 0, device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, H_q, D] over the paged cache, bottom-right causal.

    With `sliding_window` W (a positive int32; None = no window) the query at position p sees
    only keys p - W + 1 .. p, as in `torch_reference.paged_attention`; keys before a window are
    never read. Requests with one query token go to the decode kernel (tensor cores for fp16/bf16
    GQA groups of >= 4 heads; split-KV when the batch is too small to fill the GPU), the others
    to the prefill kernel (tensor cores for fp16/bf16 with head_dim % 16 == 0, CUDA cores
    otherwise); a mixed batch runs both. Returns `out`
    (allocated like query when None); rows of tokens outside every request are left untouched.
    """
    num_tokens, num_heads, head_dim = (int(s) for s in query.shape)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_reqs = metadata.num_reqs
    window = lc.check_sliding_window(sliding_window)
    if num_tokens == 0 or num_reqs == 0 or metadata.max_query_len <= 0:
        return out
    dtype_name = _check_cache(kv_cache)
    q = _as_rows(query, kv_cache.dtype)
    target = out if _is_writable_rows(out, kv_cache.dtype) else _empty_rows(q)
    batch = _Batch(
        q=q,
        out=target,
        kv_cache=kv_cache,
        block_table=_as_index(metadata.block_table, torch.int32),
        seq_lens=_as_index(metadata.seq_lens, torch.int32),
        query_start_loc=_as_index(metadata.query_start_loc, torch.int32),
        dtype_name=dtype_name,
        num_heads=num_heads,
        num_kv_heads=int(kv_cache.shape[3]),
        head_dim=head_dim,
        scale_log2=np.float32(scale * LOG2E),
        sliding_window=window,
    )
    if metadata.max_query_len > 1:
        _run_prefill(batch, metadata.max_query_len)
    _run_decode(batch, metadata.max_seq_len)
    if target is not out:
        out.copy_(target)
    return out


@dataclass(slots=True)
class _Batch:
    """The prepared tensors and sizes that one paged_attention call hands to its kernels."""

    q: torch.Tensor
    out: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dtype_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale_log2: np.float32
    sliding_window: int  # 0 = no window, as the kernels take it

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def tensor_args(self) -> tuple:
        """`PAGED_ATTENTION_TENSORS` (kernels/cuda/common.cuh): every paged-attention kernel's
        first arguments, in order."""
        return (
            _ptr(self.q),
            np.int64(self.q.stride(0)),
            _ptr(self.kv_cache[0]),
            _ptr(self.kv_cache[1]),
            _ptr(self.block_table),
            np.int32(self.block_table.stride(0)),
            _ptr(self.seq_lens),
            _ptr(self.query_start_loc),
            _ptr(self.out),
            np.int64(self.out.stride(0)),
        )

    def shape_args(self) -> tuple:
        """`PAGED_ATTENTION_SHAPE` (kernels/cuda/common.cuh), in order."""
        return (
            self.scale_log2,
            np.int32(self.sliding_window),
            np.int32(self.num_kv_heads),
            np.int32(self.num_heads // self.num_kv_heads),
        )


def decode_launch_for(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    dtype_name: str,
    device_index: int,
    sliding_window: int | None = None,
) -> lc.DecodeLaunch:
    """The decode launch `paged_attention` makes for such a batch on this device: its kernel
    compiled (once) and its occupancy read, so the splits are the ones that run. Bad head
    counts or sizes raise decode_launch's ValueError before anything is compiled."""
    lc.check_head_dim(head_dim)
    group_size = lc.check_heads(num_heads, num_kv_heads)
    kernel_name = lc.decode_kernel_name_for(dtype_name, head_dim, group_size)
    return lc.decode_launch(
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        max_seq_len,
        _num_sms(device_index),
        sliding_window=sliding_window,
        dtype_name=dtype_name,
        resident_ctas_per_sm=_resident_ctas_per_sm(kernel_name, device_index),
    )


def _run_decode(batch: _Batch, max_seq_len: int) -> None:
    launch = decode_launch_for(
        batch.num_reqs,
        batch.num_heads,
        batch.num_kv_heads,
        batch.head_dim,
        max_seq_len,
        batch.dtype_name,
        batch.device.index,
        batch.sliding_window or None,
    )
    loader = default_loader()
    kernel = loader.get_kernel(
        "decode_attention.cu", launch.kernel_name, batch.device.index, launch.shared_mem_bytes
    )
    block_size = int(batch.kv_cache.shape[2])
    block_magic, block_shift = lc.block_divider(block_size)
    partial_out = partial_lse = None
    if launch.needs_merge:
        shape = (launch.num_splits, batch.num_reqs, batch.num_heads)
        partial_out = torch.empty(
            (*shape, batch.head_dim), dtype=torch.float32, device=batch.device
        )
        partial_lse = torch.empty(shape, dtype=torch.float32, device=batch.device)
    args = (
        *batch.tensor_args(),
        _ptr(partial_out),
        _ptr(partial_lse),
        *batch.shape_args(),
        np.int32(launch.num_head_chunks),
        np.int32(block_size),
        np.uint32(block_magic),
        np.int32(block_shift),
        np.int32(launch.keys_per_split),
        np.int32(batch.num_reqs),
    )
    _launch(kernel, launch.grid, launch.block, args, launch.shared_mem_bytes, batch.device)
    if not launch.needs_merge:
        return
    merge = loader.get_kernel(
        "merge_attention_states.cu", lc.merge_kernel_name(batch.dtype_name), batch.device.index
    )
    merge_args = (
        _ptr(partial_out),
        _ptr(partial_lse),
        _ptr(batch.out),
        np.int64(batch.out.stride(0)),
        _ptr(batch.seq_lens),
        _ptr(batch.query_start_loc),
        np.int32(batch.num_reqs),
        np.int32(batch.num_heads),
        np.int32(batch.head_dim),
        np.int32(launch.keys_per_split),
        np.int32(launch.num_splits),
        np.int32(batch.sliding_window),
    )
    _launch(merge, launch.merge_grid, launch.merge_block, merge_args, 0, batch.device)


def _run_prefill(batch: _Batch, max_query_len: int) -> None:
    launch = lc.prefill_launch(
        batch.num_reqs,
        batch.num_heads,
        batch.num_kv_heads,
        batch.head_dim,
        max_query_len,
        batch.dtype_name,
    )
    _check_shared_mem(launch.shared_mem_bytes, batch.device.index, batch.head_dim)
    kernel = default_loader().get_kernel(
        launch.source_name, launch.kernel_name, batch.device.index, launch.shared_mem_bytes
    )
    args = (
        *batch.tensor_args(),
        *batch.shape_args(),
        np.int32(launch.tokens_per_tile),
        np.int32(batch.kv_cache.shape[2]),
        np.int32(1),  # skip_single_token_queries: the decode kernel serves them
    )
    _launch(kernel, launch.grid, launch.block, args, launch.shared_mem_bytes, batch.device)


def _launch(
    kernel: Any, grid: lc.Dim3, block: lc.Dim3, args: tuple, shared_mem: int, device
) -> None:
    """Launch on torch's current stream of `device` (never an empty grid)."""
    if min(grid) <= 0:
        return
    import cupy

    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        kernel(grid, block, args, shared_mem=shared_mem, stream=stream)


def _ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def _check_cache(kv_cache: torch.Tensor) -> str:
    """Returns the cache's dtype name; raises ValueError for a cache the kernels cannot read."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous for the CUDA kernels")
    try:
        name = dtype_name(kv_cache.dtype)
    except ValueError:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is not supported by the CUDA kernels; "
            f"use one of {DTYPE_NAMES}"
        ) from None
    lc.check_head_dim(int(kv_cache.shape[4]))
    return name


def _as_rows(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, D] in `dtype` whose rows are 16-byte aligned with dense [H, D] (copies if not)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not _has_aligned_rows(tensor):
        tensor = tensor.contiguous()
    return tensor


def _has_aligned_rows(tensor: torch.Tensor) -> bool:
    _, num_heads, head_dim = tensor.shape
    element_bytes = tensor.element_size()
    return (
        tensor.stride(2) == 1
        and (tensor.stride(1) == head_dim or num_heads == 1)
        and tensor.data_ptr() % lc.VECTOR_BYTES == 0
        and (tensor.stride(0) * element_bytes) % lc.VECTOR_BYTES == 0
    )


def _is_writable_rows(out: torch.Tensor, dtype: torch.dtype) -> bool:
    _, num_heads, head_dim = out.shape
    return (
        out.dtype == dtype and out.stride(2) == 1 and (out.stride(1) == head_dim or num_heads == 1)
    )


def _empty_rows(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _as_index(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def _resident_ctas_per_sm(kernel_name: str, device_index: int) -> int:
    """How many CTAs of a decode kernel one SM holds at once, from its compiled registers
    (decode's shared memory is far below any limit); read once per kernel and device."""
    kernel = default_loader().get_kernel("decode_attention.cu", kernel_name, device_index)
    shared = lc.decode_shared_mem_bytes(lc.DECODE_MAX_HEADS_PER_CTA, lc.MAX_HEAD_DIM)
    return occupancy.ctas_per_sm(kernel.num_regs, lc.DECODE_THREADS, shared)


@functools.cache
def _max_shared_mem(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", lc.DEFAULT_SHARED_MEM_BYTES))


def _check_shared_mem(needed_bytes: int, device_index: int, head_dim: int) -> None:
    limit = _max_shared_mem(device_index)
    if needed_bytes > limit:
        raise ValueError(
            f"the prefill kernel needs {needed_bytes} bytes of shared memory for "
            f"head_dim={head_dim}, above this device's limit of {limit} bytes"
        )
