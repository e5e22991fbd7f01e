"""How many bytes the KV cache may take on a device, measured (CUDA) or budgeted (CPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_MAX_BYTES = 4 * GiB
CPU_KV_CACHE_FRACTION_OF_AVAILABLE = 0.4
KV_CACHE_MEMORY_BYTES_ENV = "CORE_ENGINE_KV_CACHE_MEMORY_BYTES"


def cpu_kv_cache_bytes(override_bytes: int | None = None) -> int:
    """`override_bytes` if given, else min(4 GiB, 40% of the host's available memory)."""
    if override_bytes is not None:
        if override_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {override_bytes}")
        return override_bytes
    available = read_mem_available_bytes()
    return min(DEFAULT_CPU_KV_CACHE_MAX_BYTES, int(available * CPU_KV_CACHE_FRACTION_OF_AVAILABLE))


def kv_cache_memory_bytes_from_env(rank: int, world_size: int) -> int | None:
    """This rank's CPU KV budget from CORE_ENGINE_KV_CACHE_MEMORY_BYTES, or None when unset.

    The variable holds one byte count for every rank ("268435456") or a comma-separated list
    with one per rank ("268435456,134217728"), so ranks may report different sizes (the engine
    core then sizes the cache to the smallest). ValueError names the bad text.
    """
    text = os.environ.get(KV_CACHE_MEMORY_BYTES_ENV, "").strip()
    if not text:
        return None
    fields = [field.strip() for field in text.split(",")]
    if len(fields) not in (1, world_size) or not all(field.isdigit() for field in fields):
        raise ValueError(
            f"{KV_CACHE_MEMORY_BYTES_ENV}={text!r} must be one byte count or {world_size} "
            "comma-separated ones (one per rank)"
        )
    return int(fields[0] if len(fields) == 1 else fields[rank])


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


def cuda_graph_bytes(device: torch.device, capture_graphs: Callable[[], object]) -> int:
    """Device memory the graphs `capture_graphs` returns hold (their memory pool, and what the
    driver keeps for the graphs themselves), measured while they live, then released."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    graphs = capture_graphs()
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    del graphs
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, free_before - free_after)


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
