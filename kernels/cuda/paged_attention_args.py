"""The paged-attention kernels' shared arguments as one value: `PagedAttentionArgs` in
kernels/cuda/common.cuh, built here as a NumPy structured scalar of the same layout.

CuPy passes a structured scalar to a kernel by value, byte for byte, so the dtype's field order,
types and C alignment (`align=True`) must be the struct's; tests compare the dtype's offsets and
size with the ones the compiler reports for the struct.
"""

from __future__ import annotations

import numpy as np
import torch

PAGED_ATTENTION_ARGS = np.dtype(
    [
        ("query", np.uint64),
        ("query_token_stride", np.int64),
        ("key_cache", np.uint64),
        ("value_cache", np.uint64),
        ("block_table", np.uint64),
        ("block_table_stride", np.int32),
        ("seq_lens", np.uint64),
        ("query_start_loc", np.uint64),
        ("out", np.uint64),
        ("out_token_stride", np.int64),
        ("scale_log2", np.float32),
        ("sliding_window", np.int32),
        ("num_kv_heads", np.int32),
        ("group_size", np.int32),
        ("block_size", np.int32),
    ],
    align=True,
)


def paged_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale_log2: float,
    sliding_window: int,
    num_heads: int,
) -> np.void:
    """One kernel argument: rows of `query`/`out` (token stride in elements), the cache
    [2, num_blocks, block_size, num_kv_heads, head_dim] and int32 index tensors, on one device."""
    num_kv_heads = int(kv_cache.shape[3])
    args = np.zeros((), dtype=PAGED_ATTENTION_ARGS)
    args["query"] = query.data_ptr()
    args["query_token_stride"] = query.stride(0)
    args["key_cache"] = kv_cache[0].data_ptr()
    args["value_cache"] = kv_cache[1].data_ptr()
    args["block_table"] = block_table.data_ptr()
    args["block_table_stride"] = block_table.stride(0)
    args["seq_lens"] = seq_lens.data_ptr()
    args["query_start_loc"] = query_start_loc.data_ptr()
    args["out"] = out.data_ptr()
    args["out_token_stride"] = out.stride(0)
    args["scale_log2"] = scale_log2
    args["sliding_window"] = sliding_window
    args["num_kv_heads"] = num_kv_heads
    args["group_size"] = num_heads // num_kv_heads
    args["block_size"] = int(kv_cache.shape[2])
    return args[()]
