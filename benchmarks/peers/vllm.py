"""vLLM as a benchmark peer, run as a separate program under its own Python (`--peer-python`,
default $VLLM_PYTHON or /work/vllm-venv/bin/python) and never imported by the project:
offline through `benchmarks/peers/vllm_offline_runner.py`, online through vLLM's OpenAI server (what
`vllm serve` runs).

Both get vLLM's CPU settings: OpenMP threads bound one per core to the first `num_threads`
usable CPUs (`VLLM_CPU_OMP_THREADS_BIND`), a KV cache of KV_CACHE_GIB GiB
(`VLLM_CPU_KVCACHE_SPACE`), a context of MAX_MODEL_LEN tokens, and no network access.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.harness.common import (
    GenerationWorkload,
    cpu_list_text,
    http_server,
    usable_cpu_ids,
)
from benchmarks.harness.peer_process import PeerProcess, parse_run_result
from core_engine.common.ports import find_free_port

DEFAULT_PEER_PYTHON = "/work/vllm-venv/bin/python"
RUNNER_PATH = Path(__file__).with_name("vllm_offline_runner.py")
KV_CACHE_GIB = 4
MAX_MODEL_LEN = 2048
# vLLM CPU starts slowly (imports, torch.compile, warm-up), slower still on a small or busy
# machine; the bound is generous on purpose.
STARTUP_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 3600.0
VERSION_TIMEOUT_S = 60.0


def default_peer_python() -> str:
    return os.environ.get("VLLM_PYTHON", DEFAULT_PEER_PYTHON)


def vllm_version(python: str) -> str:
    """The version of the vLLM installed for `python` (from its package metadata, without
    importing vLLM); ValueError naming the interpreter when there is none."""
    code = (  # the distribution that provides `import vllm`: vllm, vllm-cpu, ...
        "import importlib.metadata as m; "
        "print(m.version((m.packages_distributions().get('vllm') or ['vllm'])[0]))"
    )
    try:
        completed = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S
        )
    except OSError as exc:
        raise ValueError(
            f"--peer-python {python}: cannot run it ({exc}); pass the Python of a virtual "
            "environment with vLLM installed, or set VLLM_PYTHON"
        ) from exc
    if completed.returncode != 0:
        last_line = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(
            f"--peer-python {python}: vLLM is not installed there ({last_line}); pass the Python "
            "of a virtual environment with vLLM installed, or set VLLM_PYTHON"
        )
    return completed.stdout.strip()


def vllm_cpu_ids(num_threads: int) -> list[int]:
    """The CPUs vLLM binds its `num_threads` OpenMP threads to, one each."""
    cpu_ids = usable_cpu_ids()
    if not 1 <= num_threads <= len(cpu_ids):
        raise ValueError(
            f"vLLM binds one thread per core: {num_threads} threads need between 1 and the "
            f"{len(cpu_ids)} usable cores ({cpu_list_text(cpu_ids)})"
        )
    return cpu_ids[:num_threads]


def vllm_env(cpu_ids: Sequence[int]) -> dict[str, str]:
    """This environment for a vLLM process: its CPU settings, offline, without usage stats.

    OMP_NUM_THREADS is dropped: vLLM sizes its worker's OpenMP pool from the bound CPU list,
    and leaves its other processes' torch at one thread only when OMP_NUM_THREADS is unset.
    """
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(vllm_env_settings(cpu_ids))
    return env


def vllm_env_settings(cpu_ids: Sequence[int]) -> dict[str, str]:
    """The variables `vllm_env` sets, as recorded with the results."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list_text(cpu_ids),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def workload_json(workload: GenerationWorkload) -> dict:
    return {"prompt_token_ids": workload.prompt_token_ids, "max_tokens": workload.max_tokens}


class VllmOfflinePeer:
    """vLLM's `LLM.generate` in its own process, loaded and warmed up once, then running the
    workloads it was given at start-up by name, one at a time."""

    name = "vllm"
    column = "vLLM"

    def __init__(
        self,
        python: str,
        hf_folder: Path,
        dtype: str,
        num_threads: int,
        workloads: Sequence[GenerationWorkload],
        warm_up: GenerationWorkload,
        work_dir: Path,
        seed: int = 0,
    ) -> None:
        self.cpu_ids = vllm_cpu_ids(num_threads)
        self.python = python
        self.dtype = dtype
        request = {
            "model": str(hf_folder),
            "dtype": dtype,
            "max_model_len": MAX_MODEL_LEN,
            "seed": seed,
            "warm_up": workload_json(warm_up),
            "workloads": {workload.name: workload_json(workload) for workload in workloads},
        }
        request_path = work_dir / "vllm_request.json"
        request_path.write_text(json.dumps(request))
        print(f"starting vLLM ({python}); it takes a minute or two")
        self._process = PeerProcess(
            [python, str(RUNNER_PATH), str(request_path)],
            "vLLM",
            work_dir / "vllm.log",
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
        print(f"vLLM {self.version} ready after {self.startup_s:.0f} s")

    @property
    def label(self) -> str:
        return f"vLLM {self.version} `LLM.generate`"

    def warm_up(self, workload: GenerationWorkload) -> None:
        """Nothing: the runner warmed up before it said it was ready."""

    def run(self, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
        message = self._process.request({"run": workload.name}, RUN_TIMEOUT_S)
        return parse_run_result(message, workload)

    def describe(self) -> dict:
        return {
            "label": self.label,
            "column": self.column,
            "version": self.version,
            "python": self.python,
            "dtype": self.dtype,
            "num_threads": len(self.cpu_ids),
            "env": vllm_env_settings(self.cpu_ids),
            "max_model_len": MAX_MODEL_LEN,
            "startup_s": self.startup_s,
            "note": (
                f"vLLM {self.version} ran in its own process (`{self.python}`, "
                f"`VLLM_CPU_OMP_THREADS_BIND={cpu_list_text(self.cpu_ids)}`, "
                f"`VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}`, max_model_len {MAX_MODEL_LEN}, "
                "its defaults otherwise), idle while the engine ran; its start-up and warm-up "
                "were not timed."
            ),
        }

    def close(self) -> None:
        self._process.close()


def vllm_serve_argv(
    python: str,
    hf_folder: Path,
    port: int,
    dtype: str,
    served_model_name: str,
    extra_flags: Sequence[str] = (),
) -> list[str]:
    """The OpenAI server that `vllm serve` runs with one API server (`run_server`, same
    flags), started through its module: the `vllm` command itself stops at start-up where the
    distribution is not named "vllm" (vllm-cpu 0.32.0: PackageNotFoundError for its --version)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_folder),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", served_model_name,
        "--disable-log-stats", "--disable-uvicorn-access-log", *extra_flags,
    ]  # fmt: skip


@contextlib.contextmanager
def vllm_serve(
    python: str,
    hf_folder: Path,
    dtype: str,
    num_threads: int,
    served_model_name: str,
    log_path: Path,
    extra_flags: Sequence[str] = (),
) -> Iterator[str]:
    """vLLM's OpenAI server on a free local port until the block exits; yields its base URL
    once /health answers (see `http_server`), then stops it and everything it started."""
    port = find_free_port()
    argv = vllm_serve_argv(python, hf_folder, port, dtype, served_model_name, extra_flags)
    env = vllm_env(vllm_cpu_ids(num_threads))
    with http_server(
        argv, port, "vllm serve", log_path, env=env, cwd=log_path.parent, own_session=True
    ) as url:
        yield url
