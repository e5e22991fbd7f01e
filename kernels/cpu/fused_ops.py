"""The elementwise ops of a decoder layer through the C kernels of `fused_ops.c`.

Each op does in one pass over its rows what the torch code in `worker/model_executor/layers.py` does in
several (temporaries, dtype conversions, a `cat`), computing in float32 and rounding a bf16
result once. `supports(...)` says whether the C path applies: the kernels are built and
enabled, and every tensor is a CPU tensor of float32 or bfloat16 laid out as the op needs.
The callers in `worker/model_executor/layers.py` fall back to torch otherwise (CUDA, float16,
--enforce-eager, no compiler).
"""

from __future__ import annotations

import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader

DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """The kernels are loaded and every tensor is a float32 or bfloat16 CPU tensor."""
    return cpu_kernel_loader.load() is not None and all(
        t.is_cpu and t.dtype in DTYPES for t in tensors
    )


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x IN PLACE; returns weight * residual / sqrt(mean(residual^2) + eps) in
    weight's dtype. x [T, H] and weight [H] share a dtype; residual is float32 [T, H]."""
    if not (residual.dtype == torch.float32 and x.dtype == weight.dtype):
        raise ValueError(
            f"fused_add_rms_norm needs a float32 residual and x in the weight's dtype, got "
            f"residual {residual.dtype}, x {x.dtype}, weight {weight.dtype}"
        )
    x, weight = _contiguous(x), _contiguous(weight)
    _require_contiguous(residual, "residual")
    out = torch.empty_like(x)
    cpu_kernel_loader.load().fused_add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        _is_bf16(x),
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out


def rotary_embedding_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] IN PLACE, rotate-half layout, by float32 cos/sin [T, D / 2].

    Each token's heads must be contiguous (x may be a view of a wider row, such as q and k
    at the start of a fused qkv projection)."""
    tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"rotary needs each token's heads contiguous, got strides {x.stride()}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if tuple(cos.shape) != (tokens, head_dim // 2) or cos.shape != sin.shape:
        raise ValueError(
            f"rotary angles must be [{tokens}, {head_dim // 2}], got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    cpu_kernel_loader.load().rotary_embedding_neox(
        x.data_ptr(),
        _is_bf16(x),
        tokens,
        x.stride(0),
        num_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> silu(x[:, :I]) * x[:, I:], [T, I] in x's dtype."""
    x = x.contiguous()
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype)
    cpu_kernel_loader.load().silu_and_mul(
        x.data_ptr(), out.data_ptr(), _is_bf16(x), rows, width, torch.get_num_threads()
    )
    return out


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """x.contiguous(), without the op's dispatch when x already is (once per norm per layer)."""
    return x if x.is_contiguous() else x.contiguous()


def _require_contiguous(x: torch.Tensor, name: str) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place)")
