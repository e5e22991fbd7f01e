"""Torch reference backend for paged attention: correct on any device, simple, not fast.

This is the ground truth that the CUDA kernels are tested against, and the backend the engine
uses on CPU.
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, H_kv, D] into kv_cache [2, N, block_size, H_kv, D] at slot_mapping.

    Tokens whose slot is negative are skipped; every other slot is overwritten exactly.
    """
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_cache = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat_cache[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, H_q, D] over the paged cache, bottom-right causal.

    Computes in float32 and returns query's dtype. H_q must be a multiple of H_kv (GQA).
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = metadata.block_table[r, :num_blocks].long()
        keys = kv_cache[0, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = kv_cache[1, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q_start:q_end].float().transpose(0, 1)  # [H_q, q_len, D]
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, seq, D]
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        scores.masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
