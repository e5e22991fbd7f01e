"""bf16 x bf16 matmuls on CPU through `bf16_matmul.c` (AVX512_BF16), float32 sums.

The output is rounded once to bf16 (a bf16 model's linears: the numbers oneDNN's bf16 linear
gives, up to summation order, faster at decode batch sizes) or kept in
float32 (the LM head: the float32 logits of the bf16 operands, at bf16 speed).
`Bf16MatmulWeight.pack(w)` is None where the kernel cannot run: `tile_columns()` is 0 (no C
kernels, no AVX512_BF16) or the weight is not one it `can_take` (a bf16 CPU matrix with an
even inner size); callers then keep their torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_engine.common.math_utils import round_up
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader

PAIR_LANES = 16  # output columns per 64-byte vector of packed pairs
OUTPUT_DTYPES = (torch.bfloat16, torch.float32)


def tile_columns() -> int:
    """The loaded kernel's tile width (64 output columns); 0 where it is not built."""
    library = cpu_kernel_loader.load()
    return library.bf16_matmul_tile_columns() if library is not None else 0


@dataclass(slots=True, frozen=True)
class Bf16MatmulWeight:
    """A [num_columns, k] bf16 weight packed for the kernel: rows padded to `padded_columns`
    (a multiple of the kernel's tile width) and laid out [padded / 16][k / 2][16][2]."""

    packed: torch.Tensor
    num_columns: int
    padded_columns: int
    k: int

    @staticmethod
    def can_take(weight: torch.Tensor) -> bool:
        """Whether the kernel, where it is built, multiplies by this weight."""
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] % 2 == 0
        )

    @staticmethod
    def pack(weight: torch.Tensor) -> Bf16MatmulWeight | None:
        columns = tile_columns()
        if columns == 0 or not Bf16MatmulWeight.can_take(weight):
            return None
        num_columns, k = weight.shape
        padded = round_up(num_columns, columns)
        rows = torch.zeros(padded, k, dtype=torch.bfloat16)
        rows[:num_columns] = weight.detach()
        packed = rows.view(padded // PAIR_LANES, PAIR_LANES, k // 2, 2).transpose(1, 2)
        return Bf16MatmulWeight(packed.contiguous(), num_columns, padded, k)

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [..., k] (rounded to bf16 if it is not) -> x W^T + bias, [..., num_columns] in
        `out_dtype` (bf16 or float32; None: bf16), summed in float32 and rounded once. Called
        for every linear of every step, so a bf16 contiguous x goes straight to the kernel."""
        out_dtype = out_dtype or torch.bfloat16
        if x.shape[-1] != self.k:
            raise ValueError(f"bf16 matmul needs x of shape [..., {self.k}], got {tuple(x.shape)}")
        if out_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"bf16 matmul outputs one of {OUTPUT_DTYPES}, not {out_dtype}")
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = torch.empty((*x.shape[:-1], self.num_columns), dtype=out_dtype)
        cpu_kernel_loader.load().bf16_matmul(
            x.data_ptr(),
            self.packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out_dtype == torch.bfloat16,
            x.numel() // self.k,
            self.k,
            self.padded_columns,
            self.num_columns,
            torch.get_num_threads(),
        )
        return out
