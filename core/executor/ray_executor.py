"""`RayExecutor`: worker ranks placed and watched by Ray, stepped over the engine's own links.

With `distributed_executor_backend="ray"` the engine core joins a Ray cluster (`RAY_ADDRESS`,
else one started on this host with `ray start`, else a new local one), reserves a placement
group of one bundle per rank (`ray_cpus_per_worker` CPUs, or one GPU when the cluster has GPUs
and the device allows CUDA) with `ray_placement_strategy`, and starts rank r as a
`RayWorkerActor` on bundle r. Each actor runs `python -m core_engine.worker --core-address ...`, which joins
this core over the TCP worker protocol exactly as a worker started by hand on another host
(`MultiprocExecutor` with every rank remote: `WorkerListener` on a free port of this node,
torch.distributed's rendezvous on a free port of rank 0's node). Steps, outputs and errors travel
on those links; Ray only places the processes, keeps their lifetime and reports their death.

Failures: a worker that dies, or whose node is lost, closes its link (or stops answering it) and
fails the engine as a remote worker's death does; the error adds Ray's account of the actor
(its node, and why Ray says it died) when Ray has one within RAY_ACCOUNT_WAIT_S. An actor that
ends while its link looks alive is found by `check_alive`. A placement the cluster cannot hold is
a `PlacementError` naming the missing resources within `startup_timeout_s`. `shutdown` stops the
workers over their links, then kills the actors and removes the placement group it reserved.

A data-parallel replica placed by Ray (`data_parallel_backend="ray"`) gets its placement group
from the frontend (`PLACEMENT_GROUP_ENV`) and leaves it to the frontend to remove.
"""

from __future__ import annotations

import logging

import msgspec

from core_engine.common.ports import find_free_port
from core_engine.common.ray_placement import (
    PlacementError,
    cluster_has_gpus,
    connect_to_ray,
    placement_group_from_env,
    reserve_placement_group,
    worker_bundles,
)
from core_engine.core.executor.executor import WorkerFailedError
from core_engine.core.executor.multiproc_executor import (
    MultiprocExecutor,
    WorkerProcess,
)
from core_engine.core.executor.ray_worker_actor import RayWorkerActor
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.message_pipe import PeerClosedError

logger = logging.getLogger(__name__)

# How long an error waits for Ray to say why a worker's actor ended (its link saw it first).
RAY_ACCOUNT_WAIT_S = 3.0

__all__ = ["PlacementError", "RayExecutor"]


def _tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def uses_gpus(config: EngineConfig) -> bool:
    """Workers get a GPU each on cuda, and on auto when the cluster has GPUs."""
    return config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())


class RayExecutor(MultiprocExecutor):
    """A `MultiprocExecutor` whose ranks all join over TCP from Ray actors (see the module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        import ray

        self._ray_config = config
        self._started_ray = connect_to_ray()
        self._placement_group = None
        self._owns_placement_group = False
        self._actors: list = []
        self._runs: list = []
        self._node_ips: list[str] = []
        self._released = False
        try:
            self._place_workers(config)
            rank0_port = ray.get(
                self._actors[0].free_port.remote(), timeout=config.startup_timeout_s
            )
            core_ip = ray.util.get_node_ip_address()
            joined = msgspec.structs.replace(
                config,
                distributed_executor_backend="mp",
                data_parallel_backend="mp",
                num_local_workers=0,
                worker_address=_tcp_address(core_ip, find_free_port(core_ip)),
                dist_init_address=_tcp_address(self._node_ips[0], rank0_port),
                data_parallel_size=1,  # each core has its own listener; the workers' threads
                data_parallel_rank=0,  # come from their bundles, their GPU from Ray
            )
            super().__init__(joined)
            self._runs = [self._start_worker_run(rank) for rank in range(len(self._actors))]
        except BaseException:
            self._release()
            raise

    def _place_workers(self, config: EngineConfig) -> None:
        """Reserves (or takes the frontend's) placement group and starts one actor per rank."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_workers = config.tensor_parallel_size
        self._gpus = uses_gpus(config)
        group = placement_group_from_env()
        if group is None:
            bundles = worker_bundles(num_workers, self._gpus, config.ray_cpus_per_worker)
            what = f"{num_workers} worker{'s' if num_workers > 1 else ''}"
            group = reserve_placement_group(
                bundles, config.ray_placement_strategy, config.startup_timeout_s, what
            )
            self._owns_placement_group = True
        self._placement_group = group
        actor_class = ray.remote(RayWorkerActor)
        resources = (
            {"num_gpus": 1, "num_cpus": 0}
            if self._gpus
            else {"num_cpus": config.ray_cpus_per_worker}
        )
        self._actors = [
            actor_class.options(
                **resources,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(num_workers)
        ]
        self._node_ips = ray.get(
            [actor.node_ip.remote() for actor in self._actors], timeout=config.startup_timeout_s
        )
        logger.info(
            "Ray placed %d workers (%s): %s",
            num_workers,
            config.ray_placement_strategy,
            ", ".join(f"rank {r} on {ip}" for r, ip in enumerate(self._node_ips)),
        )

    def _start_worker_run(self, rank: int):
        argv = [
            "--core-address", self.config.worker_address,
            "--rank", str(rank),
            "--world-size", str(self.config.tensor_parallel_size),
            "--connect-timeout-s", str(self.config.startup_timeout_s),
        ]  # fmt: skip
        env = {}
        if self._gpus:
            argv += ["--local-rank", "0"]  # Ray shows the actor its one GPU as device 0
        else:
            env["OMP_NUM_THREADS"] = str(self._ray_config.ray_cpus_per_worker)
        return self._actors[rank].run.remote(argv, env)

    # ---- liveness --------------------------------------------------------------------------

    def check_alive(self) -> None:
        """`MultiprocExecutor.check_alive`, then any worker actor Ray reports ended."""
        super().check_alive()
        if not self._runs:
            return
        import ray

        ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        if ended:
            rank = self._runs.index(ended[0])
            raise WorkerFailedError(f"worker rank {rank}: {self._ray_account(rank, 0.0)}")

    def _describe_death(self, worker: WorkerProcess, error: PeerClosedError | None = None) -> str:
        account = self._ray_account(worker.rank, RAY_ACCOUNT_WAIT_S)
        return f"{super()._describe_death(worker, error)}; {account}"

    def _ray_account(self, rank: int, wait_s: float) -> str:
        """Where rank `rank`'s actor ran and, if Ray knows within `wait_s`, how it ended."""
        import ray

        where = f"its Ray actor on node {self._node_ips[rank]}"
        if rank >= len(self._runs):
            return f"{where} had not started the worker"
        ended, _ = ray.wait([self._runs[rank]], timeout=wait_s)
        if not ended:
            return f"{where} is still alive as far as Ray knows"
        try:
            exit_code = ray.get(ended[0])
        except ray.exceptions.RayError as exc:
            return f"{where} died: {_first_line(exc)}"
        return f"{where} ended: the worker exited with code {exit_code}"

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the workers over their links, then releases what Ray holds for them."""
        super().shutdown()
        self._release()

    def _release(self) -> None:
        """Waits (bounded) for the workers' runs to end, kills the actors, removes the placement
        group this core reserved and disconnects from Ray if it connected. Idempotent."""
        if self._released:
            return
        self._released = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._runs:
            ray.wait(
                self._runs, num_returns=len(self._runs), timeout=self._ray_config.shutdown_timeout_s
            )
        for actor in self._actors:
            ray.kill(actor)
        if self._placement_group is not None and self._owns_placement_group:
            remove_placement_group(self._placement_group)
        if self._started_ray:
            ray.shutdown()


def _first_line(exc: BaseException) -> str:
    """Ray's errors carry tracebacks and ids over many lines; the first sentences say why."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next(
        (line for line in lines if "died" in line or "node" in line), lines[0] if lines else ""
    )
    return reason[:400] or type(exc).__name__
