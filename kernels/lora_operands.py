"""`LoRAOperands`: the shapes of one batched LoRA shrink+expand call, checked once for every
backend (the CPU kernel in `kernels/cpu/lora_shrink_expand.c`, the CUDA one in
`kernels/cuda/lora_shrink_expand.cu`).

The call computes, in place, y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for every token t whose
slot s = token_slots[t] is not -1:

- x [T, IN] and y [T, OUT]: the linear's input and output rows;
- lora_a [S, W, IN] and lora_b [S, OUT, W]: S slots of adapter weights, W = slices * max_rank
  (zero-padded rows add nothing), the adapter's scaling folded into lora_b;
- token_slots int32 [T], -1 = no adapter (the row of y is left untouched).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LoRAOperandError(ValueError):
    """An operand the kernels cannot take; `argument` names it (x, y, lora_a, lora_b or
    token_slots)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class LoRAOperands(NamedTuple):
    """The sizes of a checked call: T tokens, IN and OUT features, width W, S slots (a named
    tuple: made for every adapted linear of every step, it must cost next to nothing)."""

    num_tokens: int
    in_features: int
    out_features: int
    width: int
    num_slots: int
    dtype: torch.dtype

    @staticmethod
    def check(
        x: torch.Tensor,
        y: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        token_slots: torch.Tensor,
        dtypes: tuple[torch.dtype, ...],
        device_type: str,
    ) -> LoRAOperands:
        """The sizes of the call, or LoRAOperandError naming the first operand that is not
        contiguous, not on x's device (itself of type `device_type`), of another dtype than
        x's (one of `dtypes`; token_slots int32), or of a shape that disagrees with the
        others. Called for every adapted linear of every step: a call that is right costs a
        few dozen attribute reads, and only a wrong one is taken apart to name the culprit."""
        operands = (x, y, lora_a, lora_b, token_slots)
        sizes = _sizes_if_right(operands, dtypes, device_type)
        if sizes is not None:
            return sizes
        named = {"x": x, "y": y, "lora_a": lora_a, "lora_b": lora_b, "token_slots": token_slots}
        if x.device.type != device_type:
            raise LoRAOperandError("x", f"must be on {device_type}, is on {x.device}")
        for name, tensor in named.items():
            _check_layout(name, tensor, x.device)
        if x.dtype not in dtypes:
            raise LoRAOperandError("x", f"dtype {x.dtype} is not one of {dtypes}")
        for name in ("y", "lora_a", "lora_b"):
            if named[name].dtype != x.dtype:
                raise LoRAOperandError(
                    name, f"dtype {named[name].dtype} differs from x's {x.dtype}"
                )
        if token_slots.dtype != torch.int32:
            raise LoRAOperandError(
                "token_slots", f"dtype must be torch.int32, got {token_slots.dtype}"
            )
        _check_rank("x", x, 2, "[T, IN]")
        _check_rank("y", y, 2, "[T, OUT]")
        _check_rank("lora_a", lora_a, 3, "[S, W, IN]")
        _check_rank("lora_b", lora_b, 3, "[S, OUT, W]")
        _check_rank("token_slots", token_slots, 1, "[T]")
        num_tokens, in_features = x.shape
        num_slots, width, _ = lora_a.shape
        out_features = y.shape[1]
        expected = {
            "y": (num_tokens, out_features),
            "lora_a": (num_slots, width, in_features),
            "lora_b": (num_slots, out_features, width),
            "token_slots": (num_tokens,),
        }
        for name, shape in expected.items():
            if tuple(named[name].shape) != shape:
                raise LoRAOperandError(
                    name,
                    f"shape {tuple(named[name].shape)} should be {shape} "
                    f"(x {tuple(x.shape)}, y {tuple(y.shape)}, lora_a {tuple(lora_a.shape)})",
                )
        raise AssertionError("_sizes_if_right refused operands that every check passes")


def _sizes_if_right(
    operands: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...], device_type: str
) -> LoRAOperands | None:
    """The sizes when every check of `LoRAOperands.check` passes, else None."""
    x, y, lora_a, lora_b, token_slots = operands
    shapes = [t.shape for t in operands]
    if [len(shape) for shape in shapes] != [2, 2, 3, 3, 1]:
        return None
    (num_tokens, in_features), (_, out_features), (num_slots, width, _), _, _ = shapes
    if (
        shapes[1][0] != num_tokens
        or shapes[2][2] != in_features
        or shapes[3] != (num_slots, out_features, width)
        or shapes[4][0] != num_tokens
        or x.dtype not in dtypes
        or not (y.dtype == lora_a.dtype == lora_b.dtype == x.dtype)
        or token_slots.dtype != torch.int32
        or not all(t.is_contiguous() for t in operands)
    ):
        return None
    device = x.device
    if device.type != device_type or not all(t.device == device for t in operands[1:]):
        return None
    return LoRAOperands(num_tokens, in_features, out_features, width, num_slots, x.dtype)


def _check_layout(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise LoRAOperandError(name, f"must be on x's device {device}, is on {tensor.device}")
    if not tensor.is_contiguous():
        raise LoRAOperandError(name, f"must be contiguous, has strides {tensor.stride()}")


def _check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise LoRAOperandError(name, f"must be {layout}, got shape {tuple(tensor.shape)}")
