"""bf16 x bf16 -> float32 matmul on CPU through `cpu_bf16_matmul.c` (AVX512_BF16).

oneDNN's bf16 linear rounds its output to bf16; this one keeps the float32 sums, so the
result equals a float32 matmul of the widened operands up to summation order, reading half
the weight bytes. `Bf16MatmulWeight.pack(w)` is None where the kernel cannot run (no C
kernels, no AVX512_BF16, a weight that is not a bf16 CPU matrix with an even inner size);
callers then keep their torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_kernel_loader

PAIR_LANES = 16  # output columns per 64-byte vector of packed pairs


@dataclass(slots=True, frozen=True)
class Bf16MatmulWeight:
    """A [num_columns, k] bf16 weight packed for the kernel: rows padded to `padded_columns`
    (a multiple of the kernel's tile width) and laid out [padded / 16][k / 2][16][2]."""

    packed: torch.Tensor
    num_columns: int
    padded_columns: int
    k: int

    @staticmethod
    def pack(weight: torch.Tensor) -> Bf16MatmulWeight | None:
        library = cpu_kernel_loader.load()
        tile_columns = library.bf16_matmul_tile_columns() if library is not None else 0
        if (
            tile_columns == 0
            or weight.dtype != torch.bfloat16
            or weight.device.type != "cpu"
            or weight.dim() != 2
            or weight.shape[1] % 2
        ):
            return None
        num_columns, k = weight.shape
        padded = -(-num_columns // tile_columns) * tile_columns
        rows = torch.zeros(padded, k, dtype=torch.bfloat16)
        rows[:num_columns] = weight
        packed = rows.view(padded // PAIR_LANES, PAIR_LANES, k // 2, 2).transpose(1, 2)
        return Bf16MatmulWeight(packed.contiguous(), num_columns, padded, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] (any float dtype, rounded to bf16) -> float32 [M, num_columns] (a view
        of a [M, padded_columns] buffer)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"bf16 matmul needs x of shape [M, {self.k}], got {tuple(x.shape)}")
        x = x.to(torch.bfloat16).contiguous()
        out = torch.empty(x.shape[0], self.padded_columns, dtype=torch.float32)
        cpu_kernel_loader.load().bf16_matmul_f32_out(
            x.data_ptr(),
            self.packed.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            self.k,
            self.padded_columns,
            torch.get_num_threads(),
        )
        return out[:, : self.num_columns]
