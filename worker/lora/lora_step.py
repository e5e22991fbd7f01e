"""`LoRAStep`: which tokens of the current step go through which adapter slot."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NO_SLOT = -1
# From this many tokens, a step whose tokens all run one adapter goes through torch's matmuls,
# which beat the shrink/expand kernel's per-token products on a long prompt.
ONE_ADAPTER_MATMUL_MIN_TOKENS = 64


class LoRAStep:
    """The step's token groups, one per adapter slot in use: (slot, token rows), the rows None
    when every token of the step uses that slot; and `token_slots`, int32 [T] on the device,
    each token's slot or NO_SLOT (what the shrink/expand kernels take). Empty (`active` False)
    when no token runs an adapter: the linears then add nothing and cost nothing.

    Shared by every `LinearLoRA` of a model; `LoRAManager` sets it before a forward and clears
    it after, so a forward outside a step (profiling, warm-up) runs the base model."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.token_slots: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def runs_matmul(self, num_tokens: int) -> bool:
        """Whether the linears add the adapters with torch's matmuls rather than the kernel:
        every one of the step's `num_tokens` (at least ONE_ADAPTER_MATMUL_MIN_TOKENS) runs
        one adapter."""
        one_adapter = len(self.groups) == 1 and self.groups[0][1] is None
        return one_adapter and num_tokens >= ONE_ADAPTER_MATMUL_MIN_TOKENS

    def set_token_slots(self, row_slots: Sequence[int], num_tokens_per_row: np.ndarray) -> None:
        """Row r of the batch (its `num_tokens_per_row[r]` consecutive tokens) runs the
        adapter in slot `row_slots[r]`, or none for NO_SLOT."""
        row_slots = np.asarray(row_slots, dtype=np.int64)
        used = np.unique(row_slots[row_slots != NO_SLOT])
        if used.size == 0:
            self.clear()
            return
        token_slots = np.repeat(row_slots, num_tokens_per_row)
        self.groups = [(int(slot), self._rows_of(token_slots, slot)) for slot in used]
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(self.device)

    def _rows_of(self, token_slots: np.ndarray, slot: int) -> torch.Tensor | None:
        rows = np.flatnonzero(token_slots == slot)
        if rows.size == token_slots.size:
            return None
        return torch.from_numpy(rows).to(self.device)

    def clear(self) -> None:
        self.groups = []
        self.token_slots = None
