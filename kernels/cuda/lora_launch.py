"""`LoRALaunch`: grids, blocks and kernel names of `lora_shrink_expand.cu`; pure Python, no torch.

The constants mirror the `constexpr` values at the top of the `.cu` file (a test checks that
they agree); change both together.
"""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.common.math_utils import cdiv
from core_engine.kernels.cuda.launch_config import DTYPE_TO_CUDA_TYPE, MAX_GRID_Y, VECTOR_BYTES

SOURCE_NAME = "lora_shrink_expand.cu"
SHRINK_WARPS = 4
SHRINK_ROWS = 4  # rows of A per warp
SHRINK_TOKENS = 4
EXPAND_THREADS = 128  # output columns per CTA
EXPAND_TOKENS = 4

Dim3 = tuple[int, int, int]


def shrink_kernel_name(dtype_name: str) -> str:
    return f"lora_shrink<{DTYPE_TO_CUDA_TYPE[dtype_name]}>"


def expand_kernel_name(dtype_name: str) -> str:
    return f"lora_expand<{DTYPE_TO_CUDA_TYPE[dtype_name]}>"


@dataclass(frozen=True, slots=True)
class LoRALaunch:
    """The two launches of one call: the shrink over (token tiles, row groups of A), then the
    expand over (token tiles, column blocks of y). `vector_rows`: B's rows are read in 16-byte
    vectors (each row a whole number of them, and B 16-byte aligned)."""

    shrink_grid: Dim3
    shrink_block: Dim3
    expand_grid: Dim3
    expand_block: Dim3
    vector_rows: bool

    @staticmethod
    def of(
        num_tokens: int, width: int, out_features: int, element_bytes: int, b_address: int
    ) -> LoRALaunch:
        """The launches for T tokens of a width-W adapter into OUT columns (all positive), B of
        `element_bytes` elements at `b_address`. Raises ValueError past the grid's y limit."""
        row_groups = cdiv(width, SHRINK_WARPS * SHRINK_ROWS)
        column_blocks = cdiv(out_features, EXPAND_THREADS)
        if max(row_groups, column_blocks) > MAX_GRID_Y:
            raise ValueError(
                f"a LoRA of width {width} into {out_features} columns needs more than "
                f"{MAX_GRID_Y} CTAs along the grid's y"
            )
        row_bytes = width * element_bytes
        return LoRALaunch(
            shrink_grid=(cdiv(num_tokens, SHRINK_TOKENS), row_groups, 1),
            shrink_block=(SHRINK_WARPS * 32, 1, 1),
            expand_grid=(cdiv(num_tokens, EXPAND_TOKENS), column_blocks, 1),
            expand_block=(EXPAND_THREADS, 1, 1),
            vector_rows=row_bytes % VECTOR_BYTES == 0 and b_address % VECTOR_BYTES == 0,
        )
