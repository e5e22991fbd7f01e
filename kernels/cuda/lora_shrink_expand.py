"""The batched LoRA shrink+expand of one linear on CUDA: `lora_shrink_expand.cu` through CuPy.

y[t] += lora_b[s] @ (lora_a[s] @ x[t]) in place for every token whose slot s =
token_slots[t] is not -1 (shapes in `kernels/lora_operands.py`), float32, float16 or bfloat16,
every sum in fp32 and y rounded once. Contracts, as `backend`'s: both launches go to torch's
current stream, read at each call (CUDA-graph safe); nothing synchronizes with the host; the
only allocation is the [T, W] float32 shrink scratch, through torch; no empty grid is launched.
Slots are not range-checked on the host (that would synchronize): a slot outside [-1, S) is
skipped like -1, never read out of bounds. CuPy is imported lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core_engine.common.dtypes import dtype_name
from core_engine.kernels.cuda.lora_launch import (
    SOURCE_NAME,
    LoRALaunch,
    expand_kernel_name,
    shrink_kernel_name,
)
from core_engine.kernels.cuda.module_loader import default_loader
from core_engine.kernels.lora_operands import LoRAOperands

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Where the operands must live; the tests' CPU emulator runs the kernels on CPU tensors.
_DEVICE_TYPE = "cuda"


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """y [T, OUT] += lora_b[s] @ (lora_a[s] @ x[t]) IN PLACE for each token t with slot s =
    token_slots[t] in [0, S); rows of other tokens are not touched.

    x [T, IN], lora_a [S, W, IN], lora_b [S, OUT, W]: contiguous tensors on one CUDA device,
    of one dtype (float32, float16 or bfloat16); token_slots contiguous int32 [T]. Raises
    LoRAOperandError (a ValueError naming the argument) for anything else."""
    sizes = LoRAOperands.check(x, y, lora_a, lora_b, token_slots, DTYPES, _DEVICE_TYPE)
    if sizes.num_tokens == 0 or sizes.width == 0 or sizes.out_features == 0:
        return
    launch = LoRALaunch.of(
        sizes.num_tokens, sizes.width, sizes.out_features, x.element_size(), lora_b.data_ptr()
    )
    name = dtype_name(sizes.dtype)
    device = x.device
    shrunk = torch.empty(sizes.num_tokens, sizes.width, dtype=torch.float32, device=device)
    loader = default_loader()
    shrink = loader.get_kernel(SOURCE_NAME, shrink_kernel_name(name), device.index)
    shrink_args = (
        _ptr(x),
        _ptr(lora_a),
        _ptr(token_slots),
        _ptr(shrunk),
        np.int32(sizes.num_tokens),
        np.int32(sizes.in_features),
        np.int32(sizes.width),
        np.int32(sizes.num_slots),
    )
    _launch(shrink, launch.shrink_grid, launch.shrink_block, shrink_args, 0, device)
    expand = loader.get_kernel(SOURCE_NAME, expand_kernel_name(name), device.index)
    expand_args = (
        _ptr(shrunk),
        _ptr(lora_b),
        _ptr(token_slots),
        _ptr(y),
        np.int32(sizes.num_tokens),
        np.int32(sizes.out_features),
        np.int32(sizes.width),
        np.int32(sizes.num_slots),
        np.int32(launch.vector_rows),
    )
    _launch(expand, launch.expand_grid, launch.expand_block, expand_args, 0, device)


def _launch(
    kernel: Any, grid: tuple, block: tuple, args: tuple, shared_mem: int, device: torch.device
) -> None:
    """Launch on torch's current stream of `device` (the grids here are never empty)."""
    import cupy

    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        kernel(grid, block, args, shared_mem=shared_mem, stream=stream)


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())
