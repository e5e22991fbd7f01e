"""Attention and KV cache kernels: CUDA C via CuPy on GPUs, C kernels on CPU (`cpu_backend`),
a torch reference everywhere."""

from core_engine.kernels.attention import (
    can_capture_cuda_graphs,
    select_backend,
    write_kv_and_attend,
)
from core_engine.kernels.attention_metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "can_capture_cuda_graphs",
    "select_backend",
    "write_kv_and_attend",
]
