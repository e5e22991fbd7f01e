"""Per-step inputs of paged attention, built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core_engine.kernels.step_plans import StepPlans


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """Describes one varlen batch of query tokens over a paged KV cache.

    Shapes (T scheduled tokens, B requests):
    - `slot_mapping` int64 [T]: cache slot of each new token
      (`block_table[r, pos // block_size] * block_size + pos % block_size`), -1 = skip.
    - `block_table` int32 [B, max_blocks_per_req]: physical block ids, row r for request r.
    - `seq_lens` int32 [B]: tokens in the cache for request r after this step's write
      (context + new tokens).
    - `query_start_loc` int32 [B + 1]: request r's query tokens are rows
      `query_start_loc[r]:query_start_loc[r + 1]` of q.
    Invariant: query token i of request r (0-based within its query) sits at position
    `seq_lens[r] - q_len[r] + i` and sees keys 0..that position (bottom-right causal mask).
    `max_query_len` / `max_seq_len` are host-side ints so kernels can size grids without a sync.
    The fields never change during the step (every layer shares them); what backends derive
    from them on the first layer (the backend itself, work plans) lives in `plans`.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plans: StepPlans = field(default_factory=StepPlans, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])
