"""The batched LoRA shrink+expand of one linear on CPU, through `lora_shrink_expand.c`.

y[t] += lora_b[s] @ (lora_a[s] @ x[t]) in place for every token whose slot s =
token_slots[t] is not -1 (shapes in `kernels/lora_operands.py`), float32 or bf16, every sum in
float32 and y rounded once. `vector_floats()` is 0 where the kernel is not built (no C
compiler, CORE_ENGINE_CPU_KERNELS=0, --enforce-eager) and `supports(...)` False; callers then
keep their torch path. `lora_shrink_expand` itself raises where it cannot run.
"""

from __future__ import annotations

import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.lora_operands import LoRAOperandError, LoRAOperands

DTYPES = (torch.float32, torch.bfloat16)
_OUT_OF_MEMORY, _BAD_SLOT = -1, -2


def vector_floats() -> int:
    """The loaded kernel's vector width in floats (16 AVX-512, 8 AVX2 + FMA, 1 plain C); 0
    where it is not built."""
    library = cpu_kernel_loader.load()
    return library.lora_shrink_expand_vector_floats() if library is not None else 0


def supports(*tensors: torch.Tensor) -> bool:
    """The kernels are loaded and every tensor is a float32 or bfloat16 CPU tensor."""
    return cpu_kernel_loader.load() is not None and all(
        t.is_cpu and t.dtype in DTYPES for t in tensors
    )


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """y [T, OUT] += lora_b[s] @ (lora_a[s] @ x[t]) IN PLACE for each token t with slot s =
    token_slots[t] >= 0; rows of tokens with slot -1 are not touched.

    x [T, IN], lora_a [S, W, IN], lora_b [S, OUT, W]: contiguous CPU tensors of one dtype,
    float32 or bfloat16; token_slots contiguous int32 [T] with values in [-1, S). Raises
    LoRAOperandError (a ValueError naming the argument) for anything else, RuntimeError where
    the kernels are not built or the scratch ([T, W] float32) cannot be allocated; y is left
    untouched whenever it raises."""
    sizes = LoRAOperands.check(x, y, lora_a, lora_b, token_slots, DTYPES, "cpu")
    library = cpu_kernel_loader.load()
    if library is None:
        raise RuntimeError(
            "the CPU kernels are not built (no C compiler, CORE_ENGINE_CPU_KERNELS=0 or "
            "--enforce-eager): check vector_floats() and use the torch path"
        )
    status = library.lora_shrink_expand(
        x.data_ptr(),
        y.data_ptr(),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        token_slots.data_ptr(),
        int(sizes.dtype == torch.bfloat16),
        sizes.num_tokens,
        sizes.in_features,
        sizes.out_features,
        sizes.width,
        sizes.num_slots,
        torch.get_num_threads(),
    )
    if status == _BAD_SLOT:
        bad = token_slots[(token_slots < -1) | (token_slots >= sizes.num_slots)]
        raise LoRAOperandError(
            "token_slots",
            f"slot {int(bad[0])} is outside [-1, {sizes.num_slots}) (lora_a has "
            f"{sizes.num_slots} slots)",
        )
    if status == _OUT_OF_MEMORY:
        raise RuntimeError(
            f"lora_shrink_expand could not allocate its scratch for {sizes.num_tokens} tokens "
            f"of width {sizes.width}"
        )
