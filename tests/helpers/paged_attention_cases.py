"""Paged-attention test cases and a naive dense reference, shared by the kernel tests.

`make_case` builds a varlen batch over a paged cache whose context tokens are already written,
with blocks scattered in random order, block-table padding pointing at the null block 0, and
(by default) every unused cache slot poisoned with NaN, so a kernel that reads a slot it must
not read produces NaN. `naive_attention` is the dense, per-request, explicitly masked
definition the kernels and the torch reference are checked against. A case may carry a sliding
window; `drop_keys_before_window` then frees what the window no longer needs, as a hybrid KV
cache does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core_engine.kernels import AttentionMetadata, torch_reference


@dataclass(slots=True)
class AttentionCase:
    """One batch: new tokens' q/k/v, the cache holding each request's context, the metadata.

    `keys[r]` / `values[r]` are request r's full [seq_len, H_kv, D] K/V (context, then the new
    tokens), i.e. what the cache holds after this step's write. Query rows past
    `query_start_loc[-1]` are padding tokens (slot -1) that belong to no request. With
    `sliding_window` W the query at position p attends to keys p - W + 1 .. p only.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    q_lens: list[int]
    seq_lens: list[int]
    scale: float
    sliding_window: int | None = None

    @property
    def num_real_tokens(self) -> int:
        return sum(self.q_lens)

    def first_window_key(self, r: int) -> int:
        """The first key request r's first query token attends to (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, self.seq_lens[r] - self.q_lens[r] - self.sliding_window + 1)


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    poison: bool = True,
    num_padding_tokens: int = 0,
    seed: int = 0,
    query_std: float = 2.0,
    sliding_window: int | None = None,
) -> AttentionCase:
    """A batch where request r has seq_lens[r] tokens, the last q_lens[r] of them new.

    `query_std` > 1 makes the softmax peaky, so outputs are not averages near zero and a wrong
    weight shows up well above the tolerance. `sliding_window` only sets the case's window (what
    `naive_attention` masks with); the cache still holds every key.
    """
    if any(q > s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError(f"q_lens {q_lens} must not exceed seq_lens {seq_lens}")
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 2
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_ids, next_block = [], 0
    for count in blocks_per_req:
        block_ids.append(order[next_block : next_block + count])
        next_block += count
    max_blocks = max([1, *blocks_per_req]) + 1
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for r, ids in enumerate(block_ids):
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)

    fill = float("nan") if poison else 0.0
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    keys, values, new_keys, new_values, slots = [], [], [], [], []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        keys.append(k.to(device))
        values.append(v.to(device))
        for pos in range(seq_len):
            slot = block_ids[r][pos // block_size] * block_size + pos % block_size
            if pos < seq_len - q_len:
                kv_cache.view(2, -1, num_kv_heads, head_dim)[0, slot] = k[pos]
                kv_cache.view(2, -1, num_kv_heads, head_dim)[1, slot] = v[pos]
            else:
                slots.append(slot)
        new_keys.append(k[seq_len - q_len :])
        new_values.append(v[seq_len - q_len :])
    num_tokens = sum(q_lens) + num_padding_tokens
    padding_kv = torch.randn(num_padding_tokens, num_kv_heads, head_dim, generator=generator)
    key = (
        torch.cat([*new_keys, padding_kv.to(dtype)])
        if num_tokens
        else _empty(num_kv_heads, head_dim, dtype)
    )
    value = (
        torch.cat([*new_values, padding_kv.to(dtype)])
        if num_tokens
        else _empty(num_kv_heads, head_dim, dtype)
    )
    query = (query_std * torch.randn(num_tokens, num_heads, head_dim, generator=generator)).to(
        dtype
    )
    slot_mapping = torch.tensor(slots + [-1] * num_padding_tokens, dtype=torch.int64)
    query_start_loc = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return AttentionCase(
        query=query.to(device),
        key=key.to(device),
        value=value.to(device),
        kv_cache=kv_cache.to(device),
        metadata=metadata,
        keys=keys,
        values=values,
        q_lens=list(q_lens),
        seq_lens=list(seq_lens),
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )


def drop_keys_before_window(case: AttentionCase) -> None:
    """Frees what the case's sliding window no longer needs, as a hybrid KV cache does.

    For each request, the blocks wholly before its first query token's window become the null
    block 0 in the block table. Block 0, the blocks it replaced and every slot before that window
    (in the block straddling it too) are set to NaN, so a kernel that reads a key before the
    window, or gives one weight 0 by multiplying it, produces NaN. The new tokens' slots all lie
    at or after the window, so the slot mapping stays valid.
    """
    if case.sliding_window is None:
        raise ValueError("drop_keys_before_window needs a case with a sliding_window")
    kv_cache, block_table = case.kv_cache, case.metadata.block_table
    block_size = kv_cache.shape[2]
    kv_cache[:, 0] = float("nan")
    for r in range(len(case.seq_lens)):
        first_key = case.first_window_key(r)
        num_dropped, num_straddling = divmod(first_key, block_size)
        if num_straddling:
            kv_cache[:, int(block_table[r, num_dropped]), :num_straddling] = float("nan")
        if num_dropped:
            kv_cache[:, block_table[r, :num_dropped].long()] = float("nan")
            block_table[r, :num_dropped] = 0


def write_new_tokens(case: AttentionCase) -> None:
    """Writes the new tokens into the cache directly (no kernel), as the write step would."""
    flat = case.kv_cache.view(2, -1, *case.kv_cache.shape[3:])
    valid = case.metadata.slot_mapping >= 0
    slots = case.metadata.slot_mapping[valid]
    flat[0, slots] = case.key[valid].to(case.kv_cache.dtype)
    flat[1, slots] = case.value[valid].to(case.kv_cache.dtype)


def naive_attention(case: AttentionCase, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense attention computed in `dtype` for the real tokens: [num_real_tokens, H_q, D].

    Query token i of request r attends to keys 0 ..= seq_len - q_len + i (bottom-right causal),
    only the last `case.sliding_window` of them with a window.
    """
    outputs = []
    num_heads = case.query.shape[1]
    start = 0
    for r, (seq_len, q_len) in enumerate(zip(case.seq_lens, case.q_lens, strict=True)):
        q = case.query[start : start + q_len].to(dtype)
        start += q_len
        if q_len == 0:
            continue
        group = num_heads // case.keys[r].shape[1]
        k = case.keys[r].to(dtype).repeat_interleave(group, dim=1)
        v = case.values[r].to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos[:, None]
        if case.sliding_window is not None:
            visible &= key_pos > query_pos[:, None] - case.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
    if not outputs:
        return torch.empty(0, num_heads, case.query.shape[2], dtype=dtype, device=case.query.device)
    return torch.cat(outputs)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _empty(num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, num_heads, head_dim, dtype=dtype)


def assert_close_to_reference(case: AttentionCase, out: torch.Tensor) -> None:
    """The KERNELS.md gate: error vs fp64 <= 3x torch's own error at out's dtype, + 1e-5.

    Also: no NaN in any real token's output (unused cache slots are NaN in poisoned cases).
    """
    real = out[: case.num_real_tokens]
    assert not torch.isnan(real).any(), "NaN in the output: an unused cache slot was read"
    expected = naive_attention(case, torch.float64)
    if expected.numel() == 0:
        return
    same_dtype = naive_attention(case, out.dtype)
    torch_error = (same_dtype.double() - expected).abs().max().item()
    error = (real.double() - expected).abs().max().item()
    limit = gate_limit(torch_error)
    assert error <= limit, (
        f"max error {error:.3g} above {limit:.3g} (torch at {out.dtype}: {torch_error:.3g})"
    )


def gate_limit(torch_error: float) -> float:
    """The KERNELS.md gate for a computation whose torch equivalent is off by `torch_error`."""
    return 3 * torch_error + 1e-5


def assert_matches_torch_reference(case: AttentionCase, out: torch.Tensor) -> None:
    """`out` agrees with `torch_reference.paged_attention` (with the case's window) over the
    case's cache, which must already hold the new tokens: both are within the KERNELS.md gate of
    the fp64 definition, so they differ by at most twice the gate."""
    reference = torch_reference.paged_attention(
        case.query, case.kv_cache, case.metadata, case.scale, sliding_window=case.sliding_window
    )[: case.num_real_tokens].to(out.dtype)
    assert not torch.isnan(reference).any(), "NaN in the torch reference's output"
    if reference.numel() == 0:
        return
    expected = naive_attention(case, torch.float64)
    torch_error = (naive_attention(case, out.dtype).double() - expected).abs().max().item()
    difference = (out[: case.num_real_tokens].double() - reference.double()).abs().max().item()
    assert difference <= 2 * gate_limit(torch_error), (
        f"max difference {difference:.3g} from the torch reference "
        f"(torch at {out.dtype}: {torch_error:.3g})"
    )
