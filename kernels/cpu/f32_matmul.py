"""float32 matmuls on CPU through `f32_matmul.c` (AVX2 + FMA, no AVX-512).

The CPU worker's float32 linears and LM head run on it where it is built: faster than oneDNN
at every batch size on an AVX2 CPU (benchmarks/results/avx2/linears.md), and without
oneDNN's per-shape set-up, which the engine's ever-changing batch sizes pay again and again.
`F32MatmulWeight.pack(w)` is None where the kernel cannot run: `panel_columns()` is 0 (no C
kernels, a CPU with AVX-512 or without AVX2/FMA) or the weight is not one it `can_take` (a
float32 CPU matrix); callers then keep oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_engine.common.math_utils import round_up
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.huge_pages import HugePageArena, empty_on_huge_pages

ALIGNMENT_BYTES = 64  # the kernel's aligned loads need 32; torch's CPU allocator gives 64


def panel_columns() -> int:
    """The loaded kernel's panel width (16 output columns); 0 where it is not built."""
    library = cpu_kernel_loader.load()
    return library.f32_matmul_panel_columns() if library is not None else 0


@dataclass(slots=True, frozen=True)
class F32MatmulWeight:
    """A [num_columns, k] float32 weight packed for the kernel: rows padded to a multiple of
    `panel_columns` (16) and laid out [padded / 16][k][16], one 64-byte line per k of a
    panel."""

    packed: torch.Tensor
    num_columns: int
    k: int

    @staticmethod
    def can_take(weight: torch.Tensor) -> bool:
        """Whether the kernel, where it is built, multiplies by this weight."""
        return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2

    @staticmethod
    def pack(weight: torch.Tensor, arena: HugePageArena | None = None) -> F32MatmulWeight | None:
        """The packed copy of `weight`, in `arena` when given (a model's linears share one:
        every byte on 2 MiB pages), else on huge pages of its own; None where the kernel does
        not take it."""
        columns = panel_columns()
        if columns == 0 or not F32MatmulWeight.can_take(weight):
            return None
        num_columns, k = weight.shape
        padded = round_up(num_columns, columns)
        rows = torch.zeros(padded, k, dtype=torch.float32)
        rows[:num_columns] = weight.detach()
        shape = (padded // columns, k, columns)
        packed = (
            arena.empty(shape, torch.float32, ALIGNMENT_BYTES)
            if arena is not None
            else empty_on_huge_pages(shape, torch.float32)
        )
        packed.copy_(rows.view(padded // columns, columns, k).transpose(1, 2))
        if packed.data_ptr() % ALIGNMENT_BYTES:
            raise RuntimeError(f"packed weight at {packed.data_ptr():#x} is not 64-byte aligned")
        return F32MatmulWeight(packed, num_columns, k)

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [..., k] -> x W^T + bias, [..., num_columns] float32 (`out_dtype` None or
        float32), summed in float32. Called for every linear of every step, so a float32 x
        with unit column stride goes to the kernel as it is (any row stride)."""
        if out_dtype not in (None, torch.float32):
            raise ValueError(f"f32 matmul outputs float32, not {out_dtype}")
        rows, bias = self._kernel_operands(x, bias)
        out = torch.empty((*x.shape[:-1], self.num_columns), dtype=torch.float32)
        self._launch("f32_matmul", rows, bias, out, self.packed.shape[0], self.num_columns)
        return out

    @property
    def splits_into_gate_and_up(self) -> bool:
        """Whether this is a gate_up weight `matmul_silu_and_mul` takes: two halves that meet
        on a panel boundary (the half width a multiple of 16 columns)."""
        return self.num_columns % (2 * self.packed.shape[2]) == 0

    def matmul_silu_and_mul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., k] -> silu(gate) * up, [..., num_columns / 2] float32, where gate and up are
        the first and second half of x W^T + bias: the gated MLP's matmul and SiLU-and-mul in
        one pass (the same bits as `matmul` then fused_ops' silu_and_mul, without the
        [..., num_columns] intermediate). Needs `splits_into_gate_and_up`."""
        if not self.splits_into_gate_and_up:
            raise ValueError(
                f"matmul_silu_and_mul needs halves that are whole panels of "
                f"{self.packed.shape[2]} columns; this weight has {self.num_columns} columns"
            )
        rows, bias = self._kernel_operands(x, bias)
        width = self.num_columns // 2
        out = torch.empty((*x.shape[:-1], width), dtype=torch.float32)
        self._launch("f32_matmul_silu_and_mul", rows, bias, out, width // self.packed.shape[2])
        return out

    def _launch(
        self,
        entry_point: str,
        rows: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        *counts: int,
    ) -> None:
        """Calls `entry_point` of the kernel library with the arguments both entry points
        share (x, its row stride, the packed weight, bias, out, rows, k), then `counts` (what
        each one walks: panels and columns, or gate/up pairs), then the thread count."""
        getattr(cpu_kernel_loader.load(), entry_point)(
            rows.data_ptr(),
            rows.stride(0),
            self.packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            self.k,
            *counts,
            torch.get_num_threads(),
        )

    def _kernel_operands(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x as float32 [rows, k] with unit column stride (any row stride: a view goes as it
        is), and the bias as contiguous float32."""
        if x.shape[-1] != self.k:
            raise ValueError(f"f32 matmul needs x of shape [..., {self.k}], got {tuple(x.shape)}")
        if x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1:
            rows = x  # every linear of a float32 model: no reshape or conversion to dispatch
        else:
            rows = x.reshape(-1, self.k).to(torch.float32)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        return rows, bias
