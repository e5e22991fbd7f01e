"""`AttentionArgs`: the CPU attention kernels' arguments as one ctypes struct.

The same fields, in the same order, as `attention_args.h`; `layout_matches(library)` compares
this struct's size and offsets with what the compiled kernels report, and the tests call it.
"""

from __future__ import annotations

import ctypes

import torch

FIELDS = (
    ("query", ctypes.c_void_p),
    ("kv_cache", ctypes.c_void_p),
    ("block_table", ctypes.c_void_p),
    ("seq_lens", ctypes.c_void_p),
    ("query_start", ctypes.c_void_p),
    ("requests", ctypes.c_void_p),
    ("out", ctypes.c_void_p),
    ("block_table_stride", ctypes.c_int64),
    ("num_cache_blocks", ctypes.c_int64),
    ("num_requests", ctypes.c_int32),
    ("block_size", ctypes.c_int32),
    ("num_q_heads", ctypes.c_int32),
    ("num_kv_heads", ctypes.c_int32),
    ("head_dim", ctypes.c_int32),
    ("cache_is_bf16", ctypes.c_int32),
    ("query_is_bf16", ctypes.c_int32),
    ("sliding_window", ctypes.c_int32),
    ("scale", ctypes.c_float),
    ("num_threads", ctypes.c_int32),
)


class AttentionArgs(ctypes.Structure):
    _fields_ = FIELDS


def attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    requests: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    query_is_bf16: bool = False,
) -> AttentionArgs:
    """The struct for one kernel call: query and out contiguous float32 [T, H_q, D], kv_cache
    [2, num_blocks, block_size, H_kv, D], block_table int32 [B, stride], seq_lens int32 [B],
    query_start int32 [B + 1], requests int32 (the rows of seq_lens to attend). The tensors
    must outlive the call: the struct holds only their addresses."""
    _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return AttentionArgs(
        query=query.data_ptr(),
        kv_cache=kv_cache.data_ptr(),
        block_table=block_table.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        query_start=query_start.data_ptr(),
        requests=requests.data_ptr(),
        out=out.data_ptr(),
        block_table_stride=block_table.shape[1],
        num_cache_blocks=num_cache_blocks,
        num_requests=len(requests),
        block_size=block_size,
        num_q_heads=query.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        cache_is_bf16=kv_cache.dtype == torch.bfloat16,
        query_is_bf16=query_is_bf16,
        sliding_window=sliding_window or 0,
        scale=scale,
        num_threads=torch.get_num_threads(),
    )


def layout_of(struct: type[ctypes.Structure]) -> tuple[int, list[int]]:
    """(sizeof, field offsets in declaration order) of a ctypes struct."""
    offsets = [getattr(struct, name).offset for name, _ in struct._fields_]
    return ctypes.sizeof(struct), offsets


def python_layout() -> tuple[int, list[int]]:
    """The layout of `AttentionArgs`, the ctypes side."""
    return layout_of(AttentionArgs)


def compiled_layout(library: ctypes.CDLL) -> tuple[int, list[int]]:
    """(sizeof, field offsets) of the C struct, as the compiled kernels report them."""
    offsets = (ctypes.c_int64 * len(FIELDS))()
    size = library.attention_args_layout(offsets, len(FIELDS))
    return size, list(offsets)


def layout_matches(library: ctypes.CDLL) -> bool:
    return python_layout() == compiled_layout(library)
