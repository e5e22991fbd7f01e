"""How many bytes the KV cache may take on a device, measured (CUDA) or budgeted (CPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_MAX_BYTES = 4 * GiB
CPU_KV_CACHE_FRACTION_OF_AVAILABLE = 0.4


def cpu_kv_cache_bytes(override_bytes: int | None = None) -> int:
    """`override_bytes` if given, else min(4 GiB, 40% of the host's available memory)."""
    if override_bytes is not None:
        if override_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {override_bytes}")
        return override_bytes
    available = read_mem_available_bytes()
    return min(DEFAULT_CPU_KV_CACHE_MAX_BYTES, int(available * CPU_KV_CACHE_FRACTION_OF_AVAILABLE))


def read_mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, falling back to free physical pages elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cuda_kv_cache_bytes(
    device: torch.device,
    gpu_memory_utilization: float,
    run_peak_workload: Callable[[], None],
) -> int:
    """`total * gpu_memory_utilization` minus the peak memory of `run_peak_workload` (a dummy
    forward of the largest step) and minus memory held outside torch's allocator (CUDA context,
    CuPy modules, NCCL). Raises if nothing is left for the KV cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_peak_workload()
    torch.cuda.synchronize(device)
    peak_allocated = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    used = peak_allocated + non_torch
    budget = int(total * gpu_memory_utilization) - used
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache on {device}: the model and a step of activations "
            f"peak at {used / GiB:.2f} GiB, and gpu_memory_utilization={gpu_memory_utilization} "
            f"allows {total * gpu_memory_utilization / GiB:.2f} GiB of {total / GiB:.2f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget
