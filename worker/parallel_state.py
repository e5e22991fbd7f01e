"""Tensor-parallel state of one worker process: the torch.distributed group and its collectives.

One worker process per device, rank r of `world_size` N, all in one default process group:
NCCL on CUDA, gloo on CPU. The rendezvous is torch.distributed's own (`init_method`, by default
`env://`: `MASTER_ADDR`, `MASTER_PORT`, set by `python -m core_engine.worker` from the address the engine
core chose), so ranks on other hosts join the same way over TCP.

gloo binds each rank to one local address and tells the other ranks to connect there. Left to
itself it takes the address this host's *name* resolves to, or loopback when that address is not
bindable: on a host whose name resolves to 127.0.0.1 (common in containers), or inside a network
namespace, the other hosts would be sent an address they cannot reach. So unless
`GLOO_SOCKET_IFNAME` is set, a CPU rank sets it to the interface that holds this host's address
on the route to `MASTER_ADDR` (`gloo_interface_toward`), which the other ranks reach too.

Invariants: at `world_size == 1` nothing here touches torch.distributed (the collectives are
identities and no group is created); at `world_size > 1` every rank calls the same collectives
in the same order, which holds because every rank runs the same model on the same broadcast
`SchedulerOutput`.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEVICE_TYPE_TO_BACKEND = {"cuda": "nccl", "cpu": "gloo"}
GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (first) IPv4 address
# A rank that never arrives (crashed during start-up) is noticed by the engine core, which stops
# every worker; this bound only keeps an orphaned rank from waiting forever.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


def init_distributed(
    rank: int, world_size: int, device: torch.device, init_method: str = "env://"
) -> None:
    """Joins the default process group as `rank` of `world_size`; no-op at world_size 1 or when
    a group already exists (the caller set one up).

    On CUDA each rank has its own GPU (`worker.resolve_device` checks it). On CPU the host's cores are shared out between the ranks
    (unless `OMP_NUM_THREADS` is set), so waiting ranks do not spin on cores the others need.
    """
    if world_size == 1 or dist.is_initialized():
        return
    if device.type not in DEVICE_TYPE_TO_BACKEND:
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device.type!r}")
    if device.type == "cpu":
        share_cpu_threads(world_size)
        _choose_gloo_interface()
    dist.init_process_group(
        DEVICE_TYPE_TO_BACKEND[device.type],
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def _choose_gloo_interface() -> None:
    """Sets GLOO_SOCKET_IFNAME toward MASTER_ADDR unless the user set it (see the module doc)."""
    if os.environ.get(GLOO_SOCKET_IFNAME_ENV) or "MASTER_ADDR" not in os.environ:
        return
    master_addr = os.environ["MASTER_ADDR"]
    interface = gloo_interface_toward(master_addr, int(os.environ.get("MASTER_PORT") or 1))
    if interface is None:
        logger.warning(
            "found no network interface holding this host's address toward MASTER_ADDR=%s; gloo "
            "picks one from the host name (set %s if the ranks cannot connect)",
            master_addr,
            GLOO_SOCKET_IFNAME_ENV,
        )
        return
    os.environ[GLOO_SOCKET_IFNAME_ENV] = interface


def gloo_interface_toward(host: str, port: int = 1) -> str | None:
    """The name of the interface holding the local IPv4 address this host uses to reach `host`
    ("lo" for 127.0.0.1), or None when there is no route, `host` is IPv6, or no interface holds
    that address as its primary one (Linux only)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # a UDP connect sends nothing: it only picks a route
            local_ip = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _interface_ipv4(name) == local_ip:
            return name
    return None


def _interface_ipv4(name: str) -> str | None:
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        try:
            request = struct.pack("256s", name.encode()[:15])
            answer = fcntl.ioctl(query.fileno(), SIOCGIFADDR, request)
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(answer[20:24])


def destroy_distributed() -> None:
    """Leaves the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


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
