"""Reserving room on a Ray cluster: the connection, the bundles, the placement group, and what
is missing when the cluster cannot hold them.

Shared by the engine core (`core.executor.ray_executor`: one bundle per worker rank) and the frontend
(`frontend.ray_core_launcher`: one placement group per data-parallel replica). `ray` is imported
inside the functions only: nothing on the mp path loads it.

Contract of `reserve_placement_group`: it returns a placement group whose every bundle is placed,
or raises `PlacementError` within `timeout_s`, naming the resources the cluster lacks, after
removing the group it asked for (a pending group would otherwise hold the request open).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

Bundle = dict[str, float]

# The frontend hands a data-parallel replica's placement group to that replica's engine core.
PLACEMENT_GROUP_ENV = "CORE_ENGINE_RAY_PLACEMENT_GROUP"
# How often a pending placement says what it still waits for.
PENDING_LOG_INTERVAL_S = 10.0
PLACEMENT_POLL_INTERVAL_S = 0.2


class PlacementError(RuntimeError):
    """The cluster did not place a placement group in time; the message names what is missing."""


def connect_to_ray() -> bool:
    """Connects this process to Ray: `RAY_ADDRESS` when set (Ray reads it), else a cluster
    started on this host with `ray start`, else a new local one. True if this call connected
    (the caller disconnects with `ray.shutdown()`), False if the process already was. The
    process's SIGTERM handler is kept."""
    import ray

    if ray.is_initialized():
        return False
    # Ray's C++ handler would print a stack trace for every SIGTERM, a normal stop here.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    in_main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    if sigterm_handler is not None:
        # ray.init makes SIGTERM a sys.exit; the process keeps its own clean stop.
        signal.signal(signal.SIGTERM, sigterm_handler)
    logger.info("connected to Ray at %s", ray.get_runtime_context().gcs_address)
    return True


def worker_bundles(num_workers: int, use_gpus: bool, cpus_per_worker: int) -> list[Bundle]:
    """One bundle per worker: one GPU each, or `cpus_per_worker` CPUs (its threads)."""
    bundle = {"GPU": 1.0} if use_gpus else {"CPU": float(cpus_per_worker)}
    return [dict(bundle) for _ in range(num_workers)]


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0.0) > 0


def reserve_placement_group(bundles: Sequence[Bundle], strategy: str, timeout_s: float, what: str):
    """A placed `ray.util.placement_group.PlacementGroup` of `bundles` (see the module doc).
    `what` names the group's purpose in logs and errors ("3 workers")."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(list(bundles), strategy=strategy)
    start = time.monotonic()
    logged_s = 0.0
    while not _is_placed(group):
        waited_s = time.monotonic() - start
        if waited_s >= timeout_s:
            remove_placement_group(group)
            raise PlacementError(
                f"Ray could not place {what} within {timeout_s:g} s: "
                f"{describe_missing_resources(bundles, strategy)}"
            )
        if waited_s >= logged_s:
            logger.warning(
                "waiting for Ray to place %s (%s): %s",
                what,
                strategy,
                describe_missing_resources(bundles, strategy),
            )
            logged_s += PENDING_LOG_INTERVAL_S
        time.sleep(PLACEMENT_POLL_INTERVAL_S)
    return group


def _is_placed(group) -> bool:
    import ray

    return bool(ray.wait([group.ready()], timeout=0)[0])


def placement_group_from_env():
    """The placement group the frontend reserved for this replica (PLACEMENT_GROUP_ENV), or
    None when this engine core reserves its own."""
    group_id = os.environ.get(PLACEMENT_GROUP_ENV)
    if not group_id:
        return None
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID.from_hex(group_id))


def describe_missing_resources(bundles: Sequence[Bundle], strategy: str) -> str:
    """What the live nodes lack for `bundles` under `strategy`, in resource names and amounts."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    return missing_resources(bundles, strategy, nodes, ray.available_resources())


def missing_resources(
    bundles: Sequence[Bundle],
    strategy: str,
    node_resources: Sequence[Bundle],
    available: Bundle,
) -> str:
    """The reason `bundles` do not fit nodes with `node_resources` in all, `available` free now
    (pure: the cluster's numbers are arguments)."""
    total = _sum(bundles)
    need = f"{len(bundles)} bundles of {_format(bundles[0])} ({_format(total)} in all)"
    cluster = _sum(node_resources)
    short = {k: v - cluster.get(k, 0.0) for k, v in total.items() if v > cluster.get(k, 0.0)}
    if short:
        return f"{need}; the cluster has {_format(cluster, total)}: missing {_format(short)}"
    if strategy == "STRICT_PACK":
        best = max(node_resources, key=lambda node: _fits_count(total, node), default={})
        if _fits_count(total, best) < 1:
            return (
                f"{need}; STRICT_PACK puts them all on one node, and the largest has "
                f"{_format(best, total)}"
            )
    if strategy == "STRICT_SPREAD":
        num_fitting = sum(_fits_count(bundles[0], node) >= 1 for node in node_resources)
        if num_fitting < len(bundles):
            return (
                f"{need}; STRICT_SPREAD puts each on its own node, and only {num_fitting} "
                f"node(s) hold {_format(bundles[0])}"
            )
    if not any(_fits_count(bundles[0], node) >= 1 for node in node_resources):
        return f"{need}; no node holds one bundle of {_format(bundles[0])}"
    free = {k: v - available.get(k, 0.0) for k, v in total.items() if v > available.get(k, 0.0)}
    if free:
        return (
            f"{need}; only {_format(available, total)} is free now (other work holds the rest): "
            f"missing {_format(free)} until it ends"
        )
    return f"{need}; the cluster has room, Ray is still placing them"


def _sum(resources: Sequence[Bundle]) -> Bundle:
    total: Bundle = {}
    for resource in resources:
        for name, amount in resource.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _fits_count(bundle: Bundle, node: Bundle) -> float:
    """How many times `bundle` fits in `node` (at least 0)."""
    return min(
        (node.get(name, 0.0) / amount for name, amount in bundle.items() if amount), default=0
    )


def _format(resources: Bundle, only: Bundle | None = None) -> str:
    names = sorted(only if only is not None else resources)
    return ", ".join(f"{resources.get(name, 0.0):g} {name}" for name in names) or "nothing"
