"""`LocalExecutor`: the executor's verbs over one worker in this process.

`core.in_process_engine.InProcessEngine` steps it exactly as the engine core process steps its
worker processes, minus the processes and pipes: `scripts/generate.py`, the tests and the
benchmarks run the engine this way.
"""

from __future__ import annotations

from core_engine.proto import ModelRunnerOutput, SchedulerOutput, WorkerReady
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.worker_factory import make_worker, worker_ready
from core_engine.worker.worker_protocol import WorkerProtocol


class LocalExecutor:
    """Owns (or borrows) one loaded worker; tensor parallelism needs worker processes.

    A borrowed `worker` keeps its model; `initialize_cache` gives it a fresh KV cache and drops
    its request state. The engine's limits are the tighter of `config`'s and the worker's.
    """

    def __init__(self, config: EngineConfig, worker: WorkerProtocol | None = None) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size}: an in-process engine runs "
                "one worker; use the engine core process (LLM, core-serve) for more"
            )
        self.config = config
        if worker is None:
            worker = make_worker(config)
            worker.load_model()
        self.worker = worker

    def wait_until_ready(self) -> list[WorkerReady]:
        # With an override, the pool is not measured (on CUDA that would profile a peak step).
        return [worker_ready(self.worker, 0, self.config.num_gpu_blocks_override)]

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives as long as its owner keeps it."""
