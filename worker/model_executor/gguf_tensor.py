"""`GgufTensor`: a checkpoint weight kept as the GGUF blocks its file ships
(`--quantization gguf`), loaded into a model's parameters without being dequantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_engine.common.config_error import ConfigError
from core_engine.kernels.cpu.gguf_matmul import TYPE_NAMES, GgufSegment, block_shape


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """A [rows, k] weight as `blocks`, uint8 [rows, row_bytes] of ggml type `type_id`.

    It narrows like a tensor (`shape`, `narrow`), so a layer's weight loader shards it as it
    shards a dense weight: by rows freely, by columns on block boundaries only.
    """

    type_id: int
    blocks: torch.Tensor
    shape: tuple[int, int]

    def narrow(self, dim: int, start: int, length: int) -> GgufTensor:
        if dim == 0:
            blocks = self.blocks.narrow(0, start, length)
            return GgufTensor(self.type_id, blocks, (length, self.shape[1]))
        values, block_bytes = block_shape(self.type_id)
        if start % values or length % values:
            raise ConfigError(
                f"quantization='gguf' keeps {TYPE_NAMES[self.type_id]} blocks of {values} values, "
                f"but tensor parallelism splits a weight's {self.shape[1]} input columns at "
                f"{start} (+{length}): choose a tensor_parallel_size that splits them on block "
                "boundaries, or quantization=None"
            )
        blocks = self.blocks.narrow(
            1, start // values * block_bytes, length // values * block_bytes
        )
        return GgufTensor(self.type_id, blocks, (self.shape[0], length))

    def segment(self) -> GgufSegment:
        return GgufSegment(self.type_id, self.blocks.contiguous())
