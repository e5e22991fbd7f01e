"""The contract between the engine core and its workers, whoever runs them: `ModelExecutor`
(one step), `Executor` (start-up, steps, shutdown) and `PollableExecutor` (an executor whose
workers answer on file descriptors the engine core process polls beside its frontend socket),
and the error every executor raises when its workers cannot go on."""

from __future__ import annotations

from typing import Protocol

from core_engine.common.config_error import ConfigError
from core_engine.proto import ModelRunnerOutput, SchedulerOutput, WorkerReady


class WorkerFailedError(RuntimeError):
    """The workers cannot go on: one died, reported an error, or missed a deadline; the
    message names the rank and what happened to it."""


class ModelExecutor(Protocol):
    """What `EngineCore.step` needs of the workers: one step's model output."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step on every rank and returns rank 0's output."""
        ...


class Executor(ModelExecutor, Protocol):
    """The workers from start-up on: one worker in this process
    (`worker.local_executor.LocalExecutor`), or worker processes (`MultiprocExecutor`,
    `RayExecutor`).

    Contract: `wait_until_ready` first (every rank's `WorkerReady`, in rank order), then
    `initialize_cache` once, then any number of steps; `shutdown` stops the workers and may be
    called at any time, more than once. A failure raises `WorkerFailedError`, or `ConfigError`
    for a setting a worker cannot run with.
    """

    def wait_until_ready(self) -> list[WorkerReady]: ...

    def initialize_cache(self, num_gpu_blocks: int) -> None: ...

    def shutdown(self) -> None: ...


class PollableExecutor(Executor, Protocol):
    """An `Executor` whose workers answer on file descriptors, so that its owner (the engine
    core process) can poll them beside its own sockets while a step runs.

    A step: `send_step`, then poll `pipe_fds()`; the first readable pipe goes to
    `receive_step_output` (rank 0's answer, or the error of a worker that failed instead).
    Between steps no worker speaks unasked: a readable pipe means a failure, which
    `fail_on_message` returns; `check_alive` raises it for a worker that exited silently.
    """

    def pipe_fds(self) -> list[int]: ...

    def send_step(self, scheduler_output: SchedulerOutput) -> None: ...

    def receive_step_output(self, fd: int) -> ModelRunnerOutput: ...

    def fail_on_message(self, fd: int) -> WorkerFailedError | ConfigError: ...

    def check_alive(self) -> None: ...
