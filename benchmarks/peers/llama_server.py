"""llama.cpp's `llama-server` as an offline benchmark peer: started as a separate program on the
GGUF file itself (its weights as stored, with llama.cpp's own kernels), one slot per prompt, and
measured through its HTTP API: every prompt of a workload sent at once as token ids to
/completion (greedy, ignore_eos, no prompt cache), timed from the first send to the last reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.harness.common import GenerationWorkload, http_server
from core_engine.common.ports import find_free_port

CONTEXT_TOKENS_PER_SLOT = 2048
MAX_SLOTS = 256
REQUEST_TIMEOUT_S = 3600.0
VERSION_TIMEOUT_S = 30.0


def find_llama_server(path: str | None) -> str:
    """The llama-server program: `path` if given, else the one on PATH; ValueError saying what
    to do when there is none."""
    if path is not None:
        found = shutil.which(path)
        if found is None:
            raise ValueError(f"--llama-server {path}: no such executable program")
        return found
    found = shutil.which("llama-server")
    if found is None:
        raise ValueError(
            "--peer llama-server: llama-server is not on PATH; install llama.cpp's server or "
            "pass its path with --llama-server PATH"
        )
    return found


def llama_server_version(binary: str) -> str:
    """The first line of `llama-server --version` that names a version ("unknown" if none)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        completed = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S
        )
        for line in (completed.stdout + completed.stderr).splitlines():
            if line.lower().startswith("version"):
                return line.split(":", 1)[-1].strip()
    return "unknown"


class LlamaServerPeer:
    """A llama-server kept running for the whole benchmark, one slot per prompt."""

    name = "llama-server"
    column = "llama-server"

    def __init__(
        self, binary: str, gguf_path: Path, num_threads: int, num_slots: int, work_dir: Path
    ) -> None:
        self.binary = binary
        self.gguf_path = gguf_path
        self.num_threads = num_threads
        self.num_slots = max(1, min(num_slots, MAX_SLOTS))
        self.version = llama_server_version(binary)
        port = find_free_port()
        argv = [
            binary, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(num_threads), "-np", str(self.num_slots),
            "-c", str(self.num_slots * CONTEXT_TOKENS_PER_SLOT),
        ]  # fmt: skip
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(
            http_server(
                argv,
                port,
                "llama-server",
                work_dir / "llama-server.log",
                cwd=work_dir,
                own_session=True,
            )
        )

    @property
    def label(self) -> str:
        return f"llama.cpp llama-server ({self.version}) over HTTP"

    def warm_up(self, workload: GenerationWorkload) -> None:
        self.run(workload)

    def run(self, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
        return asyncio.run(self._run(workload))

    async def _run(self, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
        import httpx

        limits = httpx.Limits(max_connections=workload.num_prompts)
        async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
            start = time.perf_counter()
            token_ids = await asyncio.gather(
                *(
                    self._complete(client, prompt, max_tokens)
                    for prompt, max_tokens in zip(
                        workload.prompt_token_ids, workload.max_tokens, strict=True
                    )
                )
            )
            elapsed_s = time.perf_counter() - start
        return elapsed_s, list(token_ids)

    async def _complete(self, client, prompt: list[int], max_tokens: int) -> list[int]:
        body = {
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
        }  # fmt: skip
        response = await client.post(f"{self.url}/completion", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"llama-server: HTTP {response.status_code}: {response.text[:300]}")
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list) or len(tokens) != max_tokens:
            raise RuntimeError(
                f"llama-server returned {len(tokens) if isinstance(tokens, list) else 'no'} "
                f"token ids, asked {max_tokens} (it needs return_tokens support)"
            )
        return tokens

    def describe(self) -> dict:
        return {
            "label": self.label,
            "column": self.column,
            "version": self.version,
            "binary": self.binary,
            "gguf": str(self.gguf_path),
            "num_threads": self.num_threads,
            "num_slots": self.num_slots,
            "dtype": "the GGUF's own weight types",
            "note": (
                "llama-server ran the GGUF file's weights as stored, with llama.cpp's own "
                f"kernels ({self.num_threads} threads, {self.num_slots} slots), over HTTP; the "
                "engine dequantizes them to its dtype."
            ),
        }

    def close(self) -> None:
        self._stack.close()
