"""`CoreProcess`: an engine core the frontend launched, wherever it runs, and `CoreLauncher`,
what starts one.

`LocalCoreProcess` is `python -m core_engine.core` as this process's child (the default); a data-parallel
replica placed by Ray is a `frontend.ray_core_launcher.RayCoreProcess`. `AsyncCoreClient` only
asks a core process whether it has ended and stops it.
"""

from __future__ import annotations

import subprocess
from typing import Protocol

from core_engine.common.process_watch import describe_exit, python_module_command, stop_process
from core_engine.proto.engine_config import EngineConfig


class CoreProcess(Protocol):
    """Contract: `exit_reason` never blocks and, once the core has ended, says how (else None);
    `stop` asks the core to stop cleanly (SIGTERM: it fails nothing it already answered) and
    ends it outright if it outlives `timeout_s`; both may be called after the core ended."""

    @property
    def pid(self) -> int | None:
        """The core's pid when it runs on this host (None elsewhere)."""
        ...

    def exit_reason(self) -> str | None: ...

    def stop(self, timeout_s: float) -> None: ...


class CoreLauncher(Protocol):
    def launch(self, address: str, config: EngineConfig, env: dict[str, str] | None) -> CoreProcess:
        """Starts a core that connects to the frontend bound at `address`; `env` is its
        environment (None: this process's)."""
        ...


def core_arguments(address: str, config: EngineConfig) -> list[str]:
    """`python -m core_engine.core`'s arguments for a core launched by a frontend: it stops with its
    launcher (`--watch-parent`)."""
    return ["--frontend-address", address, "--config", config.to_b64(), "--watch-parent"]


class LocalCoreProcess:
    """`python -m core_engine.core` as a child of this process."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_reason(self) -> str | None:
        returncode = self.process.poll()
        if returncode is None:
            return None
        return f"engine core process {self.process.pid} exited ({describe_exit(returncode)})"

    def stop(self, timeout_s: float) -> None:
        stop_process(self.process, timeout_s)


class LocalCoreLauncher:
    def launch(
        self, address: str, config: EngineConfig, env: dict[str, str] | None
    ) -> LocalCoreProcess:
        argv = [*python_module_command("core_engine.core"), *core_arguments(address, config)]
        return LocalCoreProcess(subprocess.Popen(argv, env=env))
