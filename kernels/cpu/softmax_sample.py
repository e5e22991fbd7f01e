"""Random sampling from CPU logits at a temperature through `softmax_sample.c`: the draw
`worker/sample/inverse_cdf.py` makes from softmax(logits / temperature), in two passes over each
row instead of the softmax's tensor and a dozen torch ops (see the C file for the rule)."""

from __future__ import annotations

import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader


def supports(logits: torch.Tensor) -> bool:
    """The kernels are loaded and `logits` is a float32 [N, V] CPU tensor with unit column
    stride."""
    return (
        cpu_kernel_loader.load() is not None
        and logits.is_cpu
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
    )


def softmax_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """int64 [N]: row i's token drawn by `uniforms[i]` (in [0, 1)) from softmax(logits[i] /
    temperatures[i]), for logits `supports` takes. ValueError for a temperature that is not
    positive, or a shape that does not match."""
    num_rows, vocab = logits.shape
    if temperatures.dtype != torch.float32 or not temperatures.is_contiguous():
        temperatures = temperatures.to(torch.float32).contiguous()
    if uniforms.dtype != torch.float64 or not uniforms.is_contiguous():
        uniforms = uniforms.to(torch.float64).contiguous()
    if temperatures.shape != (num_rows,) or uniforms.shape != (num_rows,):
        raise ValueError(
            f"softmax_sample needs {num_rows} temperatures and uniforms, got "
            f"{tuple(temperatures.shape)} and {tuple(uniforms.shape)}"
        )
    tokens = torch.empty(num_rows, dtype=torch.int64)
    status = cpu_kernel_loader.load().softmax_sample(
        logits.data_ptr(),
        logits.stride(0),
        num_rows,
        vocab,
        temperatures.data_ptr(),
        uniforms.data_ptr(),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    if status < 0:
        row = -1 - status
        raise ValueError(
            f"softmax_sample needs positive temperatures, got {temperatures[row].item()} "
            f"in row {row}"
        )
    return tokens
