"""Tensor-parallel state of one worker process: the torch.distributed group and its collectives.

One worker process per device, rank r of `world_size` N, all in one default process group:
NCCL on CUDA, gloo on CPU. The rendezvous is torch.distributed's own (`init_method`, by default
`env://`: `MASTER_ADDR`, `MASTER_PORT`, set by `python -m worker` from the address the engine
core chose), so ranks on other hosts could join the same way over TCP.

Invariants: at `world_size == 1` nothing here touches torch.distributed (the collectives are
identities and no group is created); at `world_size > 1` every rank calls the same collectives
in the same order, which holds because every rank runs the same model on the same broadcast
`SchedulerOutput`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEVICE_TYPE_TO_BACKEND = {"cuda": "nccl", "cpu": "gloo"}
# A rank that never arrives (crashed during start-up) is noticed by the engine core, which stops
# every worker; this bound only keeps an orphaned rank from waiting forever.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


def init_distributed(
    rank: int, world_size: int, device: torch.device, init_method: str = "env://"
) -> None:
    """Joins the default process group as `rank` of `world_size`; no-op at world_size 1 or when
    a group already exists (the caller set one up).

    On CUDA each rank needs its own GPU (GPUs 0..N-1 of those `CUDA_VISIBLE_DEVICES` shows);
    ValueError when there are fewer. On CPU the host's cores are shared out between the ranks
    (unless `OMP_NUM_THREADS` is set), so waiting ranks do not spin on cores the others need.
    """
    if world_size == 1 or dist.is_initialized():
        return
    if device.type not in DEVICE_TYPE_TO_BACKEND:
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device.type!r}")
    if device.type == "cuda":
        check_gpu_count(world_size)
    else:
        share_cpu_threads(world_size)
    dist.init_process_group(
        DEVICE_TYPE_TO_BACKEND[device.type],
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def destroy_distributed() -> None:
    """Leaves the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_gpu_count(world_size: int) -> None:
    """ValueError unless torch sees at least `world_size` GPUs (one per rank)."""
    num_gpus = torch.cuda.device_count()
    if world_size > num_gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(
            f"tensor_parallel_size={world_size} needs one GPU per rank, but torch sees "
            f"{num_gpus} (CUDA_VISIBLE_DEVICES={visible}); lower tensor_parallel_size to at "
            f"most {num_gpus}"
        )


def share_cpu_threads(world_size: int) -> int:
    """Sets this rank's intra-op threads to its share of the usable cores (at least 1) and
    returns it; leaves torch alone when `OMP_NUM_THREADS` says what the user wants.

    The frontend and engine core processes sleep while a step runs, so the worker takes every
    core.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    num_threads = max(1, _num_usable_cores() // world_size)
    torch.set_num_threads(num_threads)
    return num_threads


def _num_usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def tensor_parallel_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sums `x` over the tensor-parallel ranks in place; identity when tp_size == 1."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim in rank order, on every rank;
    identity when tp_size == 1."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
