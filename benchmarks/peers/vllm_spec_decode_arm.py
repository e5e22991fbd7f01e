"""`VllmSpecDecodeArm`: vLLM under one speculative config (None: without), in closed-loop runs,
in its own process under its own Python (`benchmarks/peers/vllm_spec_decode_runner.py`), never imported.

It gets the CPU settings of every vLLM peer (`benchmarks/peers/vllm.py`: threads bound one per
core, KV cache size, offline); vLLM's `speculative_config` is passed as given, so a method or
field vLLM does not accept fails its start-up, and the error it gave is what the benchmark
records for that arm.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.closed_loop import ClosedLoopRun, RequestTiming
from benchmarks.harness.peer_process import PeerError, PeerProcess
from benchmarks.peers.vllm import (
    KV_CACHE_GIB,
    MAX_MODEL_LEN,
    RUN_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    vllm_cpu_ids,
    vllm_env,
    vllm_env_settings,
)
from benchmarks.spec_decode.counts import SpecDecodeCounts
from benchmarks.spec_decode.workloads import DecodeWorkload

RUNNER_PATH = Path(__file__).with_name("vllm_spec_decode_runner.py")


class VllmSpecDecodeArm:
    """A started vLLM (the constructor waits for its ready message; PeerError carries the
    error vLLM gave when it refuses the config or fails to start)."""

    def __init__(
        self,
        label: str,
        python: str,
        hf_folder: Path,
        dtype: str,
        num_threads: int,
        speculative_config: dict | None,
        workloads: Sequence[DecodeWorkload],
        warm_up: DecodeWorkload,
        work_dir: Path,
        seed: int = 0,
    ) -> None:
        self.label = label
        self.python = python
        self.dtype = dtype
        self.speculative_config = speculative_config
        self.cpu_ids = vllm_cpu_ids(num_threads)
        file_stem = "vllm_" + label.replace(" ", "_").replace("/", "_")
        request = {
            "model": str(hf_folder),
            "dtype": dtype,
            "max_model_len": MAX_MODEL_LEN,
            "seed": seed,
            "speculative_config": speculative_config,
            "warm_up": warm_up.to_json(),
            "workloads": {workload.name: workload.to_json() for workload in workloads},
        }
        request_path = work_dir / f"{file_stem}_request.json"
        request_path.write_text(json.dumps(request))
        print(f"starting vLLM ({label}, {python}); it takes a few minutes")
        self._process = PeerProcess(
            [python, str(RUNNER_PATH), str(request_path)],
            f"vLLM ({label})",
            work_dir / f"{file_stem}.log",
            env=vllm_env(self.cpu_ids),
            cwd=work_dir,
        )
        try:
            ready = self._process.start(STARTUP_TIMEOUT_S)
        except BaseException:
            self._process.close()
            raise
        self.version = str(ready["version"])
        self.startup_s = float(ready.get("startup_s", 0.0))
        print(f"vLLM {self.version} ({label}) ready after {self.startup_s:.0f} s")

    def run(
        self, workload: DecodeWorkload, num_prompts: int, concurrency: int
    ) -> tuple[ClosedLoopRun, SpecDecodeCounts]:
        command = {"run": workload.name, "num_prompts": num_prompts, "concurrency": concurrency}
        message = self._process.request(command, RUN_TIMEOUT_S)
        return parse_closed_loop_result(message, workload.name, num_prompts)

    def describe(self) -> dict:
        return {
            "version": self.version,
            "python": self.python,
            "dtype": self.dtype,
            "speculative_config": self.speculative_config,
            "num_threads": len(self.cpu_ids),
            "env": vllm_env_settings(self.cpu_ids),
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_gib": KV_CACHE_GIB,
            "startup_s": self.startup_s,
        }

    def close(self) -> None:
        self._process.close()


def parse_closed_loop_result(
    message: dict, workload_name: str, num_prompts: int
) -> tuple[ClosedLoopRun, SpecDecodeCounts]:
    """The run and counts of a result message; PeerError when it is not the result of
    `workload_name` with one record per prompt."""
    if message.get("type") != "result" or message.get("workload") != workload_name:
        raise PeerError(f"expected the result of {workload_name!r}, got {str(message)[:200]}")
    elapsed_s = message.get("elapsed_s")
    records = message.get("requests")
    if not isinstance(elapsed_s, (int, float)) or elapsed_s <= 0:
        raise PeerError(f"elapsed_s must be a positive number of seconds, got {elapsed_s!r}")
    if not isinstance(records, list) or len(records) != num_prompts:
        count = len(records) if isinstance(records, list) else records
        raise PeerError(f"the peer returned {count} request records for {num_prompts} prompts")
    try:
        requests = [RequestTiming.from_json(record) for record in records]
        counts = SpecDecodeCounts.from_json(message.get("spec_decode") or {})
    except ValueError as exc:
        raise PeerError(f"the peer's result for {workload_name!r}: {exc}") from exc
    return ClosedLoopRun(float(elapsed_s), requests), counts
