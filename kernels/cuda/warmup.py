"""Attention warm-up for the worker to call once at start, before the first request.

On CUDA this compiles (or loads from CuPy's disk cache) every kernel configuration the model's
shapes need: cache write, prefill, decode unsplit and split, and the split merge, so that no
request pays for NVRTC. On CPU it runs the same batches through `cpu_backend`: its C kernels
(built, or loaded from their disk cache, on first use) or, without them, the torch reference, so
no request pays for building or loading the kernels.
"""

from __future__ import annotations

import torch

from core_engine.common.math_utils import cdiv
from core_engine.kernels.attention import write_kv_and_attend
from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cuda.launch_config import SplitPolicy

# Long enough that a single request takes the split-KV path on any GPU.
WARMUP_CONTEXT_LEN = 2 * SplitPolicy().min_keys_per_split


def warmup(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
) -> None:
    """Runs write_kv_and_attend on a prefill, a long decode and a mixed batch; returns when done.

    Uses its own small cache (about WARMUP_CONTEXT_LEN tokens), so it touches no engine state.
    """
    device = torch.device(device)
    num_blocks = cdiv(WARMUP_CONTEXT_LEN + 8, block_size) + 1
    kv_cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    long_len, short_len = WARMUP_CONTEXT_LEN, 3
    long_blocks = list(range(1, cdiv(long_len + 1, block_size) + 1))
    short_blocks = [num_blocks - 1]
    steps = [
        [(long_len, long_len, long_blocks)],  # prefill: (seq_len, q_len, blocks)
        [(long_len + 1, 1, long_blocks)],  # decode, split-KV when the GPU is large enough
        [(long_len + 1, 1, long_blocks), (short_len, short_len, short_blocks)],  # mixed
    ]
    for requests in steps:
        metadata = _metadata(requests, block_size, device)
        num_tokens = int(metadata.slot_mapping.shape[0])
        query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        write_kv_and_attend(query, key, torch.randn_like(key), kv_cache, metadata, head_dim**-0.5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _metadata(
    requests: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    slots, query_start_loc = [], [0]
    max_blocks = max(len(blocks) for _, _, blocks in requests)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    for row, (seq_len, q_len, blocks) in enumerate(requests):
        block_table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(len(slots))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor([r[0] for r in requests], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max(r[1] for r in requests),
        max_seq_len=max(r[0] for r in requests),
    )
