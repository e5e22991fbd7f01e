"""Torch reference backend for paged attention: correct on any device, simple, not fast.

This is the ground truth that the CUDA and CPU C kernels are tested against. On CPU the engine
uses `kernels/cpu/backend.py`, which sends queries too long for its C kernel to this module's
SDPA prefill and falls back to this module wholly without the C kernels (no compiler,
--enforce-eager) or for a cache they do not take (its dtype or head size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core_engine.common.math_utils import cdiv
from core_engine.kernels.attention_metadata import AttentionMetadata


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
# Every request of a decode chunk is padded to the chunk's longest; one shorter than this
# fraction of it starts a new chunk instead (otherwise one long request makes every short
# request in its chunk attend over its padding).
DECODE_MIN_FILL = 0.75


@dataclass(slots=True, frozen=True)
class PrefillRequest:
    """One request with more than one query token: rows q_start:q_end over seq_len keys."""

    q_start: int
    q_end: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]


@dataclass(slots=True, frozen=True)
class _DecodeChunk:
    """Requests with one query token each, attended together over their gathered blocks.

    Request i's keys are gathered into rows i * padded_len ... of a [num_rows * padded_len]
    slot buffer; `padding_slots` are the buffer rows past each request's length, which are
    zeroed (they may hold another request's data or NaN) and masked out by `key_mask`.
    """

    token_index: torch.Tensor  # int64 [num_rows]: the query row of each request
    block_ids: torch.Tensor  # int64 [num_rows * num_blocks], request-major
    padding_slots: torch.Tensor  # int64 [P]
    key_mask: torch.Tensor  # bool [num_rows, 1, 1, padded_len], True = attend
    num_rows: int
    padded_len: int


@dataclass(slots=True, frozen=True)
class _AttentionPlan:
    """What one step's metadata means for this backend; built on the first layer only."""

    prefills: list[PrefillRequest]
    decodes: list[_DecodeChunk]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, H_q, D] over the paged cache, bottom-right causal.

    Computes in float32 and returns query's dtype. H_q must be a multiple of H_kv (GQA).
    With `sliding_window` W, the query at position p sees only keys p - W + 1 .. p (W keys,
    itself included), as transformers' sliding-window layers do.
    Requests with one query token (decodes) are batched into a few fused SDPA calls; longer
    queries (prefill chunks) run one request at a time. Cache slots past a request's length
    never reach the output, even when they hold NaN.
    """
    if out is None:
        out = torch.empty_like(query)
    plan = metadata.plans.get(
        ("torch_reference", tuple(kv_cache.shape[2:]), sliding_window),
        lambda: _build_plan(metadata, kv_cache, sliding_window),
    )
    for request in plan.prefills:
        prefill_attention(query, kv_cache, scale, out, request, sliding_window)
    for chunk in plan.decodes:
        _decode_attention(query, kv_cache, scale, out, chunk)
    return out


def _build_plan(
    metadata: AttentionMetadata, kv_cache: torch.Tensor, sliding_window: int | None = None
) -> _AttentionPlan:
    block_size = kv_cache.shape[2]
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    block_table = metadata.block_table.long()
    prefills, decode_rows = [], []
    for row, seq_len in enumerate(seq_lens):
        q_len = starts[row + 1] - starts[row]
        if q_len == 1:
            decode_rows.append(row)
        elif q_len > 1:
            prefills.append(prefill_request(row, starts, seq_len, block_table, block_size))
    decodes = [
        _decode_chunk(rows, starts, seq_lens, block_table, block_size, sliding_window)
        for rows in _decode_chunks(decode_rows, seq_lens, kv_cache)
    ]
    return _AttentionPlan(prefills, decodes)


def prefill_request(
    row: int, starts: list[int], seq_len: int, block_table: torch.Tensor, block_size: int
) -> PrefillRequest:
    """Request `row` of a step (`starts` = query_start_loc as a list, block_table int64)."""
    num_blocks = cdiv(seq_len, block_size)
    return PrefillRequest(starts[row], starts[row + 1], seq_len, block_table[row, :num_blocks])


def _decode_chunks(rows: list[int], seq_lens: list[int], kv_cache: torch.Tensor) -> list[list[int]]:
    """`rows` by descending length, split into chunks whose requests are all at least
    DECODE_MIN_FILL of the chunk's longest (the length every request is padded to) and whose
    gathered K stays under DECODE_GATHER_BYTES."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    bytes_per_token = num_kv_heads * head_dim * 4
    chunks: list[list[int]] = []
    for row in sorted(rows, key=lambda row: -seq_lens[row]):
        if chunks:
            chunk = chunks[-1]
            longest = seq_lens[chunk[0]]
            fits = (len(chunk) + 1) * longest * bytes_per_token <= DECODE_GATHER_BYTES
            if fits and seq_lens[row] >= DECODE_MIN_FILL * longest:
                chunk.append(row)
                continue
        chunks.append([row])
    return chunks


def _decode_chunk(
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> _DecodeChunk:
    device = block_table.device
    num_blocks = cdiv(max(seq_lens[row] for row in rows), block_size)
    padded_len = num_blocks * block_size
    row_index = torch.tensor(rows, device=device)
    lengths = torch.tensor([seq_lens[row] for row in rows], device=device)
    key_positions = torch.arange(padded_len, device=device)[None, :]
    attend = key_positions < lengths[:, None]
    if sliding_window is not None:  # the query sits at position length - 1
        attend &= key_positions >= lengths[:, None] - sliding_window
    return _DecodeChunk(
        token_index=torch.tensor([starts[row] for row in rows], device=device),
        block_ids=block_table[row_index, :num_blocks].reshape(-1),
        # Keys before a window are zeroed too: their blocks may be gone (the null block).
        padding_slots=torch.nonzero(~attend.reshape(-1)).reshape(-1),
        key_mask=attend[:, None, None, :],
        num_rows=len(rows),
        padded_len=padded_len,
    )


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [N, block_size, H_kv, D] -> its blocks `block_ids` as [len * block_size, H_kv, D].

    Rows of a 2-D view are copied whole: one contiguous copy per block, much cheaper on CPU than
    indexing the 4-D cache."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    request: PrefillRequest,
    sliding_window: int | None = None,
) -> None:
    """One request's query tokens against its first `seq_len` cached tokens (only the last
    `sliding_window` of them up to each query's position, when given)."""
    num_kv_heads = kv_cache.shape[3]
    q_start, q_end, seq_len = request.q_start, request.q_end, request.seq_len
    q_len = q_end - q_start
    group = query.shape[1] // num_kv_heads
    if sliding_window is not None and seq_len > sliding_window:
        key_start = max(0, seq_len - q_len - sliding_window + 1)  # the first query's first key
        keys = _gather_blocks(kv_cache[0], request.block_ids)[key_start:seq_len]
        values = _gather_blocks(kv_cache[1], request.block_ids)[key_start:seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(key_start, seq_len, device=query.device)[None, :]
        window_mask = (key_pos <= query_pos) & (key_pos > query_pos - sliding_window)
        _attend(query[q_start:q_end], keys, values, window_mask, scale, out[q_start:q_end], group)
        return
    keys = _gather_blocks(kv_cache[0], request.block_ids)[:seq_len]
    values = _gather_blocks(kv_cache[1], request.block_ids)[:seq_len]
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
    # A leading batch dim keeps SDPA on its fused CPU kernel (3-D inputs take a much slower
    # unfused path).
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


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    group: int,
) -> None:
    """out[i] = attention of query [q, H_q, D] over keys/values [k, H_kv, D] where mask [q, k]."""
    result = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None],
        keys.float().transpose(0, 1)[None],
        values.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=group > 1,
    )[0]
    out.copy_(result.transpose(0, 1).to(out.dtype))


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    chunk: _DecodeChunk,
) -> None:
    """One fused SDPA over the chunk's requests: each KV head's query group plays the part of
    a short query sequence ([B, H_kv, group, D]), so GQA needs no repeated K/V, and the
    gathered K/V are read through strided views, without another copy."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    group = query.shape[1] // num_kv_heads
    shape = (chunk.num_rows, chunk.padded_len, num_kv_heads, head_dim)
    keys = _gather_blocks(kv_cache[0], chunk.block_ids)
    values = _gather_blocks(kv_cache[1], chunk.block_ids)
    # Zero the padding so NaN there cannot leak (0 * NaN is NaN even under a -inf mask).
    keys.view(keys.shape[0], -1).index_fill_(0, chunk.padding_slots, 0.0)
    values.view(values.shape[0], -1).index_fill_(0, chunk.padding_slots, 0.0)
    q = query[chunk.token_index].float().view(chunk.num_rows, num_kv_heads, group, head_dim)
    result = F.scaled_dot_product_attention(
        q,
        keys.float().view(shape).transpose(1, 2),
        values.float().view(shape).transpose(1, 2),
        attn_mask=chunk.key_mask,
        scale=scale,
    )  # [B, H_kv, group, D]
    out[chunk.token_index] = result.reshape(chunk.num_rows, -1, head_dim).to(out.dtype)
