"""`make_executor`: the engine core's workers for `EngineConfig.distributed_executor_backend`.

"mp" is `MultiprocExecutor` (the core's child processes, and ranks joining from other hosts);
"ray" is `RayExecutor` (every rank placed by Ray), imported only then: the mp path never loads
Ray.
"""

from __future__ import annotations

from core_engine.core.executor.executor import PollableExecutor
from core_engine.core.executor.multiproc_executor import MultiprocExecutor
from core_engine.proto.engine_config import EngineConfig


def make_executor(config: EngineConfig) -> PollableExecutor:
    """Starts the workers `config` asks for; their handshake is the caller's."""
    if config.distributed_executor_backend == "ray":
        from core_engine.core.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    return MultiprocExecutor(config)
