"""The one attention entry point the model calls: write new K/V, then paged attention.

The backend is chosen once per step (on the first layer, kept in the metadata's `plans`) by
the cache's device: CUDA tensors go to the CuPy kernels when CuPy is
installed, CPU tensors to the C kernel of `cpu_backend` (which falls back to the torch reference
without a C compiler), anything else to the torch reference. Every backend takes a sliding
window, so a sliding-window layer runs on the same backend as a full-attention one.
"""

from __future__ import annotations

import torch

from core_engine.kernels import torch_reference
from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cpu import backend as cpu_backend


def write_kv_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [T, H_q, D], key/value [T, H_kv, D], kv_cache [2, N, block_size, H_kv, D].

    Writes key/value through `metadata.slot_mapping`, then returns attention output [T, H_q, D]
    over each request's cached context plus its new tokens; with `sliding_window` W, the query
    at position p attends to keys p - W + 1 .. p only (transformers' convention). Keys before
    a window are never read, so a hybrid KV cache may free their blocks (block id 0 in the
    block table).
    """
    backend = metadata.plans.get(
        ("backend", kv_cache.device), lambda: select_backend(kv_cache.device)
    )
    backend.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
    if sliding_window is not None and metadata.max_seq_len <= sliding_window:
        sliding_window = None  # no query of this step has a key before its window
    return backend.paged_attention(query, kv_cache, metadata, scale, sliding_window=sliding_window)


def can_capture_cuda_graphs(device: torch.device) -> bool:
    """Whether attention on `device` can be captured in a CUDA graph: the CuPy kernels launch
    without reading anything on the host; the torch reference backend reads the step's lengths
    on the host, so it runs eagerly."""
    if device.type != "cuda":
        return False
    from core_engine.kernels.cuda import backend as cuda_backend

    return cuda_backend.is_available()


def select_backend(device: torch.device):
    """Returns a module with `reshape_and_cache` and `paged_attention` for this device."""
    if device.type == "cuda":
        from core_engine.kernels.cuda import backend as cuda_backend

        if cuda_backend.is_available():
            return cuda_backend
    if device.type == "cpu":
        return cpu_backend
    return torch_reference
