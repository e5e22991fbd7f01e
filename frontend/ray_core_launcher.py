"""`RayCoreLauncher`: data-parallel replicas placed by Ray (`data_parallel_backend="ray"`).

The frontend joins the Ray cluster and reserves one placement group per replica, one bundle per
tensor-parallel rank (as `core.executor.ray_executor` would for one core). Replica r's engine core runs in
a `RayCoreActor` on bundle 0 of its group (asking for no resources of its own, so it sits on
rank 0's node): the actor runs `python -m core_engine.core --watch-parent` as its child, which connects to
this frontend over TCP (the frontend binds its node's address) and places its workers on the
group's bundles (`PLACEMENT_GROUP_ENV`). The prefix-aware router and everything above it are the
same as for cores that are this frontend's children.

Lifecycle: `RayCoreProcess.exit_reason` reports the core's exit, or its actor's death (a lost
node) as Ray gives it; `stop` sends the core SIGTERM through its actor, then kills the actor.
`release` removes the placement groups (Ray then ends whatever still runs in them) and
disconnects from Ray if it connected. Ray ends the actors with this process (they are its own).
"""

from __future__ import annotations

import logging
import os
import subprocess

from core_engine.common.ports import find_free_port_pair
from core_engine.common.process_watch import python_module_command, stop_process
from core_engine.common.ray_placement import (
    PLACEMENT_GROUP_ENV,
    cluster_has_gpus,
    connect_to_ray,
    reserve_placement_group,
    worker_bundles,
)
from core_engine.frontend.core_process import core_arguments
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# How long a stop waits for the actor to pass SIGTERM on, on top of the core's own bound.
STOP_CALL_MARGIN_S = 5.0


class RayCoreActor:
    """Hosts one replica's engine core process on its node (see the module doc). Threaded
    (max_concurrency 2), so that `stop` runs while `run` waits."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """Runs `python -m core_engine.core` with `argv` and `env` on top of this process's environment;
        its exit code."""
        command = [*python_module_command("core_engine.core"), *argv]
        self._process = subprocess.Popen(command, env={**os.environ, **env})
        return self._process.wait()

    def stop(self, timeout_s: float) -> None:
        if self._process is not None:
            stop_process(self._process, timeout_s)


class RayCoreProcess:
    """A `CoreProcess` running in a `RayCoreActor`."""

    def __init__(self, actor, run, label: str) -> None:
        self._actor = actor
        self._run = run
        self._label = label

    @property
    def pid(self) -> None:
        return None  # on a node of Ray's choosing

    def exit_reason(self) -> str | None:
        import ray

        if not ray.wait([self._run], timeout=0)[0]:
            return None
        try:
            return f"{self._label} exited with code {ray.get(self._run)}"
        except ray.exceptions.RayError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = next((line for line in lines if "died" in line), lines[0] if lines else "")
            return f"{self._label}'s Ray actor died: {reason[:400]}"

    def stop(self, timeout_s: float) -> None:
        import ray

        try:
            ray.get(self._actor.stop.remote(timeout_s), timeout=timeout_s + STOP_CALL_MARGIN_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.info("%s did not stop through its actor (%s); killing it", self._label, exc)
        ray.kill(self._actor)


class RayCoreLauncher:
    """Places `config.data_parallel_size` replicas; a `CoreLauncher` per replica via
    `for_replica`. Not thread-safe; `reserve` may run on a thread, the rest on the event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._started_ray = False
        self._groups: list = []
        self._node_ip: str | None = None

    def reserve(self) -> None:
        """Connects to Ray and places every replica's group (blocking, bounded by
        startup_timeout_s per replica); PlacementError names what the cluster lacks."""
        import ray

        self._started_ray = connect_to_ray()
        self._node_ip = ray.util.get_node_ip_address()
        config = self.config
        use_gpus = config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())
        size, tp = config.data_parallel_size, config.tensor_parallel_size
        for rank in range(size):
            bundles = worker_bundles(tp, use_gpus, config.ray_cpus_per_worker)
            what = f"data-parallel replica {rank} of {size} ({tp} worker{'s' if tp > 1 else ''})"
            self._groups.append(
                reserve_placement_group(
                    bundles, config.ray_placement_strategy, config.startup_timeout_s, what
                )
            )

    def frontend_address(self) -> str:
        """A tcp address on this node for one core to connect to."""
        return f"tcp://{self._node_ip}:{find_free_port_pair(self._node_ip)}"

    def for_replica(self, rank: int) -> _ReplicaLauncher:
        return _ReplicaLauncher(self._groups[rank], f"engine core {rank} (Ray)")

    def release(self) -> None:
        """Removes the placement groups; disconnects from Ray if `reserve` connected."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()
        if self._started_ray:
            ray.shutdown()


class _ReplicaLauncher:
    """Launches one replica's core on bundle 0 of its placement group."""

    def __init__(self, group, label: str) -> None:
        self._group = group
        self._label = label

    def launch(
        self, address: str, config: EngineConfig, env: dict[str, str] | None
    ) -> RayCoreProcess:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=0)
        actor = (
            ray.remote(RayCoreActor)
            .options(num_cpus=0, max_concurrency=2, max_restarts=0, scheduling_strategy=strategy)
            .remote()
        )
        core_env = {
            **(env or {}),
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            PLACEMENT_GROUP_ENV: self._group.id.hex(),
        }
        run = actor.run.remote(core_arguments(address, config), core_env)
        return RayCoreProcess(actor, run, self._label)
