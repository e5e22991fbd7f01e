"""`RayWorkerActor`: the Ray actor that is one rank's worker process on its bundle's node.

`RayExecutor` starts one per rank. Its `run` is `python -m core_engine.worker --core-address ...` in the
actor's own process (the module run by name, as `MultiprocExecutor` starts `python -m core_engine.worker` by
name, so the engine core never imports `worker/` or torch): the worker joins the core over the
engine's TCP worker protocol and serves steps on that link, and `run` returns its exit code when
it ends. The actor and the worker are one process, so whatever ends one ends the other: a lost
node or `ray.kill` closes the worker's link at once, and Ray reports the actor's death.

This module imports nothing of Ray at module level: Ray loads it in its worker processes by
reference, and the mp path never loads it.
"""

from __future__ import annotations

import os
import runpy
import sys

from core_engine.common.ports import find_free_port

WORKER_MODULE = "core_engine.worker"


class RayWorkerActor:
    """A placed process waiting for its worker's arguments (see the module doc)."""

    def node_ip(self) -> str:
        """The address Ray knows this node by: where the other ranks reach this one."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A port free on this node now (rank 0's node serves torch.distributed's rendezvous)."""
        return find_free_port(self.node_ip())

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """Runs the worker with `argv` after setting `env` (before torch loads, so that
        OMP_NUM_THREADS counts); returns its exit code once it ends."""
        os.environ.update(env)
        sys.argv = [WORKER_MODULE, *argv]
        try:
            runpy.run_module(WORKER_MODULE, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0
