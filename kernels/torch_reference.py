"""Torch reference backend for paged attention: correct on any device, simple, not fast.

This is the ground truth that the CUDA kernels are tested against, and the backend the engine
uses on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


# Cap on the gathered K (or V) bytes of one batched decode chunk, so a large batch of long
# contexts is processed in pieces instead of materialising every request's KV at once.
DECODE_GATHER_BYTES = 64 * 1024 * 1024


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, H_q, D] over the paged cache, bottom-right causal.

    Computes in float32 and returns query's dtype. H_q must be a multiple of H_kv (GQA).
    Requests with one query token (decodes) are batched into a few large ops; longer queries
    (prefill chunks) run one request at a time. Cache slots past a request's length never
    reach the output, even when they hold NaN.
    """
    if out is None:
        out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    decode_rows = []
    for row, seq_len in enumerate(seq_lens):
        q_len = starts[row + 1] - starts[row]
        if q_len == 1:
            decode_rows.append(row)
        elif q_len > 1:
            _request_attention(query, kv_cache, metadata, scale, out, row, starts, seq_len)
    for chunk_rows in _decode_chunks(decode_rows, seq_lens, kv_cache):
        _decode_chunk(query, kv_cache, metadata, scale, out, chunk_rows, starts, seq_lens)
    return out


def _decode_chunks(rows: list[int], seq_lens: list[int], kv_cache: torch.Tensor) -> list[list[int]]:
    """`rows` split so one chunk's gathered K stays under DECODE_GATHER_BYTES."""
    if not rows:
        return []
    num_kv_heads, head_dim = kv_cache.shape[3:]
    bytes_per_request = max(seq_lens[row] for row in rows) * num_kv_heads * head_dim * 4
    chunk = max(1, DECODE_GATHER_BYTES // bytes_per_request)
    return [rows[first : first + chunk] for first in range(0, len(rows), chunk)]


def _request_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    row: int,
    starts: list[int],
    seq_len: int,
) -> None:
    """One request's query tokens against its first `seq_len` cached tokens."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    q_start, q_end = starts[row], starts[row + 1]
    q_len = q_end - q_start
    group = query.shape[1] // num_kv_heads
    num_blocks = (seq_len + block_size - 1) // block_size
    block_ids = metadata.block_table[row, :num_blocks].long()
    keys = kv_cache[0, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = kv_cache[1, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    q = query[q_start:q_end].float().transpose(0, 1)  # [H_q, q_len, D]
    k = keys.float().transpose(0, 1)  # [H_kv, seq, D]
    v = values.float().transpose(0, 1)
    # Bottom-right causal: query i sits at position seq_len - q_len + i. SDPA's is_causal is
    # top-left aligned, so it is used only when the query covers the whole sequence.
    if q_len == seq_len:
        mask = None
    else:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
    # A leading batch dim keeps SDPA on its fused CPU kernel (3-D inputs take a slow path:
    # 113 ms vs 27 ms for a 1,000-token causal prefill here).
    result = F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=group > 1,
    )[0]
    out[q_start:q_end] = result.transpose(0, 1).to(out.dtype)


def _decode_chunk(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
) -> None:
    """Single-token queries of `rows`, batched: gather each request's blocks, pad to the
    longest, mask the padding (keys to -inf, values to 0 so NaN padding cannot leak)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    device = query.device
    num_rows = len(rows)
    group = query.shape[1] // num_kv_heads
    max_seq_len = max(seq_lens[row] for row in rows)
    num_blocks = (max_seq_len + block_size - 1) // block_size
    padded_len = num_blocks * block_size
    row_index = torch.tensor(rows, device=device)
    token_index = torch.tensor([starts[row] for row in rows], device=device)
    lengths = torch.tensor([seq_lens[row] for row in rows], device=device)
    block_ids = metadata.block_table[row_index, :num_blocks].long()
    keys = kv_cache[0][block_ids].reshape(num_rows, padded_len, num_kv_heads, head_dim).float()
    values = kv_cache[1][block_ids].reshape(num_rows, padded_len, num_kv_heads, head_dim).float()
    padding = torch.arange(padded_len, device=device)[None, :] >= lengths[:, None]  # [B, S]
    values = values.masked_fill(padding[:, :, None, None], 0.0)
    q = query[token_index].float().view(num_rows, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * scale  # [B, H_kv, group, S]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, H_kv, group, D]
    out[token_index] = result.reshape(num_rows, -1, head_dim).to(out.dtype)
