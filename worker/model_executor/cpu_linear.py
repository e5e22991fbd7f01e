"""oneDNN linears with weights pre-packed once at load, for the CPU worker.

`torch.nn.functional.linear` hands MKL the row-major weight at every call, and MKL re-blocks
it for its micro-kernel each time; at decode batch sizes that copy is a large part of the
matmul. oneDNN can block the weight once (`_reorder_linear_weight`) and run every later
matmul on the blocked copy (`_linear_pointwise`, the pair torch's inductor uses for frozen CPU
linears). The blocked copy replaces the dense weight: it is the only copy kept.

Packing applies to float32 wherever torch has oneDNN, and to bfloat16/float16 only where
oneDNN says the CPU runs them (AVX-512 or AMX); elsewhere layers keep `F.linear`. Two weights
go to the project's own kernels instead, where they are built: a bf16 weight on a CPU with
AVX512_BF16 (`kernels.cpu.bf16_matmul`: faster than oneDNN at decode batch sizes, and able to
output float32, which the LM head needs), and a float32 weight on an AVX2 CPU without AVX-512
(`kernels.cpu.f32_matmul`: faster than oneDNN at every batch size there).

`choose_kernel` makes that choice from a `CpuLinearCapabilities`, all it asks of the machine:
the same code on every CPU, tested with the capabilities of each kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from core_engine.kernels.cpu import bf16_matmul as cpu_bf16_matmul
from core_engine.kernels.cpu import f32_matmul as cpu_f32_matmul
from core_engine.kernels.cpu.bf16_matmul import Bf16MatmulWeight
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.kernels.cpu.gguf_matmul import GgufMatmulWeight, GgufSegment
from core_engine.kernels.cpu.huge_pages import HugePageArena
from core_engine.worker.lora.linear_lora import LinearLoRA


class LinearKernel(enum.Enum):
    """What a CPU linear's matmul runs on."""

    BF16_MATMUL = "kernels/cpu/bf16_matmul.c"
    F32_MATMUL = "kernels/cpu/f32_matmul.c"
    ONEDNN = "oneDNN on the blocked weight"
    DENSE = "F.linear on the dense weight (not packed)"


@dataclass(slots=True, frozen=True)
class CpuLinearCapabilities:
    """What this machine runs a linear on: the project's matmul kernels its kernel build
    holds, and the weight dtypes oneDNN computes in. `read` gets them; tests build them for
    each kind of CPU."""

    has_bf16_matmul: bool  # bf16_matmul.c is built (AVX512_BF16)
    has_f32_matmul: bool  # f32_matmul.c is built (AVX2 + FMA without AVX-512)
    onednn_dtypes: frozenset[torch.dtype]

    @staticmethod
    def read() -> CpuLinearCapabilities:
        """This machine's, as the kernel loader is set now (none with --enforce-eager)."""
        return CpuLinearCapabilities(
            has_bf16_matmul=cpu_bf16_matmul.tile_columns() > 0,
            has_f32_matmul=cpu_f32_matmul.panel_columns() > 0,
            onednn_dtypes=onednn_dtypes(),
        )


def onednn_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes oneDNN runs linears in on this CPU: float32 wherever torch has
    oneDNN, bfloat16 and float16 where oneDNN says the CPU runs them (AVX-512 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN runs a linear with this weight's dtype on this CPU."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in onednn_dtypes()


def choose_kernel(
    weight: torch.Tensor, packed_dtype: torch.dtype | None, capabilities: CpuLinearCapabilities
) -> LinearKernel:
    """What a linear with this [out, in] weight runs on once packed: the bf16 kernel for a
    weight it takes (it outputs float32 too, so `packed_dtype` does not matter to it); else,
    for the weight in `packed_dtype` (None: its own dtype), the float32 kernel, oneDNN, or
    nothing (DENSE)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return LinearKernel.DENSE
    if capabilities.has_bf16_matmul and Bf16MatmulWeight.can_take(weight):
        return LinearKernel.BF16_MATMUL
    dtype = packed_dtype or weight.dtype
    if capabilities.has_f32_matmul and dtype == torch.float32:
        return LinearKernel.F32_MATMUL
    if dtype in capabilities.onednn_dtypes:
        return LinearKernel.ONEDNN
    return LinearKernel.DENSE


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
    kernel_weight: Bf16MatmulWeight | F32MatmulWeight | GgufMatmulWeight | None = None
    # The dtype the packed matmul outputs (oneDNN: also computes in); None: the weight's own.
    packed_dtype: torch.dtype | None = None
    # LoRA adapters' weights beside this linear (worker.lora), with LoRA enabled.
    lora: LinearLoRA | None = None

    @property
    def runs_lora(self) -> bool:
        """Whether some token of the current step goes through an adapter of this linear."""
        return self.lora is not None and self.lora.step.active

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this linear's output for x) plus the step's adapters' contributions."""
        if self.lora is not None and self.lora.step.active:
            self.lora.add_to(x, y)
        return y

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

    def pack(
        self,
        keep_dense_weight: bool,
        capabilities: CpuLinearCapabilities | None = None,
        arena: HugePageArena | None = None,
    ) -> bool:
        """Packs the weight for what `choose_kernel` picks with this machine's `capabilities`
        (None: read them); returns whether it packed. `keep_dense_weight`: another module
        reads the same tensor (tied embeddings). `arena`: where the float32 kernel's packed
        copy goes (None: huge pages of its own). Raises RuntimeError where the capabilities
        name a kernel that is not built."""
        if self.is_packed:
            return False
        if self.weight.gguf_segments:
            # Blocks another module reads (a tied embedding's) stay where they are.
            self.kernel_weight = gguf_weight_of(self.weight, None if keep_dense_weight else arena)
            if not keep_dense_weight:
                self.weight = None
            return True
        capabilities = capabilities or CpuLinearCapabilities.read()
        kernel = choose_kernel(self.weight, self.packed_dtype, capabilities)
        if kernel is LinearKernel.DENSE:
            return False
        weight = self.weight
        if kernel is not LinearKernel.BF16_MATMUL and self.packed_dtype is not None:
            weight = weight.to(self.packed_dtype)
        if kernel is LinearKernel.BF16_MATMUL:
            self.kernel_weight = Bf16MatmulWeight.pack(weight)
        elif kernel is LinearKernel.F32_MATMUL:
            self.kernel_weight = F32MatmulWeight.pack(weight, arena)
        else:
            self.packed_weight = pack_weight(weight)
        if not self.is_packed:
            raise RuntimeError(f"{kernel.value} was chosen for a linear but is not built")
        if not keep_dense_weight:
            self.weight = None
        return True


def gguf_weight_of(param: nn.Parameter, arena: HugePageArena | None = None) -> GgufMatmulWeight:
    """The GGUF segments a parameter was loaded as, as one weight (its blocks moved into
    `arena`, on 2 MiB pages, when given); RuntimeError unless they cover its first rows
    without a gap (a loader bug, never a user's). Only a vocabulary split over ranks leaves
    rows uncovered: the padding rows of the last rank."""
    segments = [param.gguf_segments[row] for row in sorted(param.gguf_segments)]
    firsts = sorted(param.gguf_segments)
    covered = [first + segment.num_rows for first, segment in zip(firsts, segments, strict=True)]
    if firsts[0] != 0 or covered[:-1] != firsts[1:] or covered[-1] > param.shape[0]:
        raise RuntimeError(
            f"GGUF segments at rows {firsts} do not cover a weight of {param.shape[0]} rows"
        )
    weight = GgufMatmulWeight.of(segments)
    if arena is None:
        return weight
    moved = []
    for segment in weight.segments:
        blocks = arena.empty(tuple(segment.blocks.shape), torch.uint8, 64)
        moved.append(GgufSegment(segment.type_id, blocks.copy_(segment.blocks)))
    return GgufMatmulWeight(tuple(moved), weight.k)


def pack_linears(model: nn.Module) -> int:
    """Packs every `PackableLinear` of a loaded CPU model; returns how many were packed.

    Loading must be finished: a packed layer has no dense weight left to load into. A model
    that is not an nn.Module (a test double) has nothing to pack.
    """
    if not isinstance(model, nn.Module):
        return 0
    linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m.weight is not None]
    if not linears:
        return 0
    capabilities = CpuLinearCapabilities.read()
    shared = _shared_weight_ids(model)
    arena = HugePageArena()  # the float32 kernel's packed weights, side by side on 2 MiB pages
    return sum(module.pack(id(module.weight) in shared, capabilities, arena) for module in linears)


def _shared_weight_ids(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {param_id for param_id, count in seen.items() if count > 1}


def model_weight_bytes(model: nn.Module) -> int:
    """The bytes a loaded model's weights hold in memory: each kernel's packed or block copy,
    oneDNN's blocked copies, and every parameter still dense (a tied weight once). A parameter
    loaded as GGUF blocks and never written holds none (its pages were never touched)."""
    if not isinstance(model, nn.Module):
        return 0
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.kernel_weight is not None:
            weight = module.kernel_weight
            tensors = (
                [s.blocks for s in weight.segments]
                if isinstance(weight, GgufMatmulWeight)
                else [weight.packed]
            )
        elif isinstance(module, PackableLinear) and module.packed_weight is not None:
            tensors = [module.packed_weight]
        else:
            tensors = []
        tensors += [p for p in module.parameters(recurse=False) if not p.gguf_segments]
        for tensor in tensors:
            # oneDNN's blocked copies are opaque: no storage, so no data pointer to key them by
            key = id(tensor) if tensor.is_mkldnn else tensor.data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total
