"""Matmuls and embedding lookups on weights kept as the GGUF blocks their file ships, through
`gguf_matmul.c` (`--quantization gguf`).

A `GgufMatmulWeight` is one or more `GgufSegment`s, each a run of output rows of one block type
(a fused weight such as qkv may join tensors of different types: a Q4_K_M file stores some
projections in Q6_K); its matmul writes each segment's columns of one float32 output. Nothing is
dequantized ahead: resident weight memory stays the file's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader

# ggml's type ids of the block types the kernel takes, by name.
GGUF_MATMUL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
TYPE_NAMES = {type_id: name for name, type_id in GGUF_MATMUL_TYPES.items()}
# Values and bytes per block, as gguf_matmul.c reports them (and ggml defines them).
BLOCK_SHAPES = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}
FLOAT32_BYTES = 4


def is_available() -> bool:
    """Whether the kernel library (any build: the kernel has a plain C path) is loaded."""
    return cpu_kernel_loader.load() is not None


def block_shape(type_id: int) -> tuple[int, int]:
    """(values, bytes) of one block of `type_id`; ValueError for a type the kernel lacks."""
    if type_id not in BLOCK_SHAPES:
        names = ", ".join(GGUF_MATMUL_TYPES)
        raise ValueError(f"ggml type {type_id} is not one the GGUF matmul takes ({names})")
    return BLOCK_SHAPES[type_id]


@dataclass(slots=True, frozen=True)
class GgufSegment:
    """`blocks` uint8 [num_rows, row_bytes]: rows of k / block values blocks of `type_id`."""

    type_id: int
    blocks: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.blocks.shape[0]

    def k(self) -> int:
        values, block_bytes = block_shape(self.type_id)
        return self.blocks.shape[1] // block_bytes * values


@dataclass(slots=True, frozen=True)
class GgufMatmulWeight:
    """A [num_columns, k] weight as GGUF block segments, stacked by rows in order.

    Invariant: every segment has k values per row, and blocks are contiguous uint8 CPU tensors.
    """

    segments: tuple[GgufSegment, ...]
    k: int

    @staticmethod
    def of(segments: Sequence[GgufSegment]) -> GgufMatmulWeight:
        """The weight of `segments` (adjacent ones of one type joined into one), checked."""
        if not segments:
            raise ValueError("a GGUF weight needs at least one segment")
        k = segments[0].k()
        joined: list[GgufSegment] = []
        for segment in segments:
            if segment.blocks.dtype != torch.uint8 or segment.blocks.dim() != 2:
                raise ValueError("GGUF blocks must be a uint8 [rows, row_bytes] tensor")
            if segment.k() != k:
                raise ValueError(f"GGUF segments of {segment.k()} and {k} values per row")
            if joined and joined[-1].type_id == segment.type_id:
                blocks = torch.cat([joined[-1].blocks, segment.blocks])
                joined[-1] = GgufSegment(segment.type_id, blocks)
            else:
                joined.append(GgufSegment(segment.type_id, segment.blocks.contiguous()))
        return GgufMatmulWeight(tuple(joined), k)

    @property
    def num_columns(self) -> int:
        return sum(segment.num_rows for segment in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(segment.blocks.numel() for segment in self.segments)

    def describe(self) -> str:
        """The block types, as a log names them ("Q4_1", "Q4_K+Q6_K")."""
        return "+".join(TYPE_NAMES[segment.type_id] for segment in self.segments)

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [..., k] -> x W^T + bias, [..., num_columns], summed in float32 (out_dtype None or
        float32: the kernel's; another dtype: converted). Called for every linear of every
        step: a float32 2-D x with unit column stride goes to the kernel as it is, and each
        segment writes its columns of one output through pointer offsets (a torch op costs
        microseconds; a decode step makes over a hundred of these calls)."""
        if x.shape[-1] != self.k:
            raise ValueError(f"GGUF matmul needs x of shape [..., {self.k}], got {tuple(x.shape)}")
        rows = x
        if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
            rows = x.reshape(-1, self.k).to(torch.float32)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
        bias_address = None
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
            bias_address = bias.data_ptr()
        num_columns = self.num_columns
        out = torch.empty((rows.shape[0], num_columns), dtype=torch.float32)
        kernel = cpu_kernel_loader.load().gguf_matmul
        x_address, row_stride, out_address = rows.data_ptr(), rows.stride(0), out.data_ptr()
        num_rows, num_threads = rows.shape[0], torch.get_num_threads()
        first = 0
        for segment in self.segments:
            offset = first * FLOAT32_BYTES
            kernel(
                x_address,
                row_stride,
                segment.blocks.data_ptr(),
                segment.type_id,
                None if bias_address is None else bias_address + offset,
                out_address + offset,
                num_columns,
                num_rows,
                self.k,
                segment.num_rows,
                num_threads,
            )
            first += segment.num_rows
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], num_columns)
        return out if out_dtype in (None, torch.float32) else out.to(out_dtype)

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows `row_ids` (an embedding lookup), float32 [*row_ids.shape, k]; IndexError for an
        id outside [0, num_columns)."""
        ids = row_ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel():
            lowest, highest = torch.aminmax(ids)
            if not 0 <= int(lowest) <= int(highest) < self.num_columns:
                raise IndexError(f"row ids must be in [0, {self.num_columns})")
        out = torch.empty((ids.shape[0], self.k), dtype=torch.float32)
        library = cpu_kernel_loader.load()
        if len(self.segments) == 1:  # every row in one segment: no masks
            segment = self.segments[0]
            library.gguf_dequantize_rows(
                segment.blocks.data_ptr(), segment.type_id, self.k, ids.data_ptr(),
                ids.shape[0], out.data_ptr(),
            )  # fmt: skip
            return out.view(*row_ids.shape, self.k)
        first = 0
        for segment in self.segments:
            inside = (ids >= first) & (ids < first + segment.num_rows)
            positions = None if bool(inside.all()) else torch.nonzero(inside).flatten()
            local = ((ids if positions is None else ids[positions]) - first).contiguous()
            if local.numel():
                part = out
                if positions is not None:
                    part = torch.empty((local.shape[0], self.k), dtype=torch.float32)
                library.gguf_dequantize_rows(
                    segment.blocks.data_ptr(),
                    segment.type_id,
                    self.k,
                    local.data_ptr(),
                    local.shape[0],
                    part.data_ptr(),
                )
                if positions is not None:
                    out[positions] = part
            first += segment.num_rows
        return out.view(*row_ids.shape, self.k)
