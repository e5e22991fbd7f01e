"""oneDNN linears with weights pre-packed once at load, for the CPU worker.

`torch.nn.functional.linear` hands MKL the row-major weight at every call, and MKL re-blocks
it for its micro-kernel each time; at decode batch sizes that copy is a large part of the
matmul. oneDNN can block the weight once (`_reorder_linear_weight`) and run every later
matmul on the blocked copy (`_linear_pointwise`, the pair torch's inductor uses for frozen CPU
linears). The blocked copy replaces the dense weight: it is the only copy kept.

Packing applies to float32 wherever torch has oneDNN, and to bfloat16/float16 only where
oneDNN says the CPU runs them (AVX-512 or AMX); elsewhere layers keep `F.linear`. Two weights
go to the project's own kernels instead, where they are built: a bf16 weight on a CPU with
AVX512_BF16 (`kernels.cpu_bf16_matmul`: faster than oneDNN at decode batch sizes, and able to
output float32, which the LM head needs), and a float32 weight on an AVX2 CPU without AVX-512
(`kernels.cpu_f32_matmul`: faster than oneDNN at every batch size there).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_bf16_matmul import Bf16MatmulWeight
from kernels.cpu_f32_matmul import F32MatmulWeight

ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN runs a linear with this weight's dtype on this CPU."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of a [out_features, in_features] weight (no batch-size hint:
    measured as fast as a hinted one for every batch size from 1 to 1,024)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W blocked by `pack_weight`; same result as F.linear to
    float rounding (a different summation order)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [None], "")


class PackableLinear(nn.Module):
    """A linear layer whose `weight` [out, in] may be swapped for a packed copy: one of the
    project's kernels (`kernel_weight`: bf16 or float32) or oneDNN's blocked one
    (`packed_weight`).

    After `pack()` the dense `weight` is None unless another module shares it (a tied
    embedding); forward must go through `matmul`.
    """

    packed_weight: torch.Tensor | None = None
    kernel_weight: Bf16MatmulWeight | F32MatmulWeight | None = None
    # The dtype the packed matmul outputs (oneDNN: also computes in); None: the weight's own.
    packed_dtype: torch.dtype | None = None

    @property
    def is_packed(self) -> bool:
        return self.kernel_weight is not None or self.packed_weight is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel_weight is not None:
            return self.kernel_weight.matmul(x, bias, self.packed_dtype)
        if self.packed_weight is not None:
            if self.packed_dtype is not None:
                x = x.to(self.packed_dtype)
            return packed_linear(x, self.packed_weight, bias)
        return torch.nn.functional.linear(x, self.weight, bias)

    def pack(self, keep_dense_weight: bool) -> bool:
        """Packs the weight for one of the project's kernels or oneDNN if this CPU runs its
        dtype; returns whether it did. `keep_dense_weight`: another module reads the same
        tensor (tied embeddings)."""
        if self.is_packed:
            return False
        weight = self.weight
        self.kernel_weight = Bf16MatmulWeight.pack(weight)
        if self.kernel_weight is None:
            if self.packed_dtype is not None:
                weight = weight.to(self.packed_dtype)
            self.kernel_weight = F32MatmulWeight.pack(weight)
        if self.kernel_weight is None:
            if not can_pack(weight):
                return False
            self.packed_weight = pack_weight(weight)
        if not keep_dense_weight:
            self.weight = None
        return True


def pack_linears(model: nn.Module) -> int:
    """Packs every `PackableLinear` of a loaded CPU model; returns how many were packed.

    Loading must be finished: a packed layer has no dense weight left to load into. A model
    that is not an nn.Module (a test double) has nothing to pack.
    """
    if not isinstance(model, nn.Module):
        return 0
    shared = _shared_weight_ids(model)
    packed = 0
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.weight is not None:
            packed += module.pack(keep_dense_weight=id(module.weight) in shared)
    return packed


def _shared_weight_ids(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {param_id for param_id, count in seen.items() if count > 1}
