"""`LinearLoRA`: the adapters of one base linear, stacked in slots, added to its output.

vLLM's punica shape: per slot in use, shrink (x A^T, [T, slices * rank]) then expand (times B^T
into the output rows), onto only the rows of the tokens that use the slot; every slot in one
kernel call (`kernels/cpu/lora_shrink_expand.c`, `kernels/cuda/lora_shrink_expand.cu`), or
in torch where no kernel runs or one adapter's whole prompt is one large matmul. A linear
that fuses several projections (qkv, gate_up) keeps their A matrices side by side ([slices *
rank, in]) and their B matrices block-diagonal ([out, slices * rank]), so one shrink and one
expand serve every projection. Ranks below `max_lora_rank` and projections an adapter does not
target are zero-padded: they add exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core_engine.kernels.cpu import lora_shrink_expand as cpu_lora
from core_engine.worker.lora.lora_step import LoRAStep


@dataclass(frozen=True, slots=True)
class LoRASlice:
    """One projection of a fused linear: the checkpoint's module name, the rows of its B (the
    unsharded output) this rank holds, and where they go in this rank's output."""

    module: str
    source_rows: slice
    output_offset: int


class LinearLoRA:
    """Slots of adapter weights for one linear: `lora_a` [slots, slices * rank, in_rank],
    `lora_b` [slots, out_rank, slices * rank], the adapter's scaling folded into B.

    `input_columns`: the columns of A (the unsharded input) this rank holds, for a row-parallel
    linear; its partial output is summed over ranks with the base output's, and since the
    expand is linear in the shrink, the sum is the adapter's whole contribution."""

    def __init__(
        self,
        step: LoRAStep,
        slices: list[LoRASlice],
        in_features: int,
        out_features: int,
        max_rank: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        input_columns: slice | None = None,
    ) -> None:
        self.step = step
        self.slices = slices
        self.max_rank = max_rank
        self.input_columns = input_columns
        width = len(slices) * max_rank
        self.lora_a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)

    def write_slot(self, slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts one adapter's matrices for this linear (module -> (A [r, in], B [out, r] with
        the scaling applied)) into `slot`; projections it lacks become zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, piece in enumerate(self.slices):
            if piece.module not in weights:
                continue
            lora_a, lora_b = weights[piece.module]
            rank = lora_a.shape[0]
            if self.input_columns is not None:
                lora_a = lora_a[:, self.input_columns]
            lora_b = lora_b[piece.source_rows]
            first = index * self.max_rank
            rows = slice(piece.output_offset, piece.output_offset + lora_b.shape[0])
            self.lora_a[slot, first : first + rank] = torch.from_numpy(np.ascontiguousarray(lora_a))
            self.lora_b[slot, rows, first : first + rank] = torch.from_numpy(
                np.ascontiguousarray(lora_b)
            )

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's adapter applied to x (x [T, in_rank], y [T, out_rank])."""
        kernel = self._kernel_for(x, y)
        if kernel is not None:
            kernel(x.contiguous(), y, self.lora_a, self.lora_b, self.step.token_slots)
            return
        self._add_in_torch(x, y)

    def _kernel_for(self, x: torch.Tensor, y: torch.Tensor):
        """The shrink/expand kernel for this call, or None for the torch path."""
        if self.step.runs_matmul(x.shape[0]):
            return None
        if not (x.dtype == y.dtype == self.lora_a.dtype and y.is_contiguous()):
            return None
        if x.is_cuda:
            from core_engine.kernels.cuda import lora_shrink_expand as cuda_lora

            return cuda_lora.lora_shrink_expand
        if cpu_lora.supports(x, self.lora_a):
            return cpu_lora.lora_shrink_expand
        return None

    def _add_in_torch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for slot, rows in self.step.groups:
            lora_a, lora_b = self.lora_a[slot], self.lora_b[slot]
            if rows is None:
                y.add_(torch.mm(torch.mm(x.to(lora_a.dtype), lora_a.t()), lora_b.t()))
                continue
            shrunk = torch.mm(x.index_select(0, rows).to(lora_a.dtype), lora_a.t())
            y.index_add_(0, rows, torch.mm(shrunk, lora_b.t()).to(y.dtype))
