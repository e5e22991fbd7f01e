"""Killing part of an engine while `LLM.generate` runs, and checking what `generate` raised."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from core_engine.frontend import LLM, EngineDeadError
from tests.helpers.server_process import descendant_pids

GENERATING_TIMEOUT_S = 120.0


def engine_worker_pids(llm: LLM) -> list[int]:
    """The pids of the worker processes under the LLM's engine core (the mp executor)."""
    core_pid = llm._client.engine._core.core_pid
    return [
        pid
        for pid in descendant_pids(core_pid)
        if b"core_engine.worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]


def kill_once_generating(llm: LLM, num_requests: int, kill: Callable[[], None]) -> threading.Thread:
    """A started thread that waits until `num_requests` requests run and have produced tokens,
    then calls `kill`. It kills after GENERATING_TIMEOUT_S in any case (so that the generate
    under test ends), and sets `thread.saw_generating` to whether the requests were seen."""

    def wait_then_kill() -> None:
        deadline = time.monotonic() + GENERATING_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                stats = llm._client.get_stats()
                if stats.num_running_reqs == num_requests and stats.num_generation_tokens > 0:
                    thread.saw_generating = True
                    return
                time.sleep(0.05)
        finally:
            kill()

    thread = threading.Thread(target=wait_then_kill, name="kill-once-generating", daemon=True)
    thread.saw_generating = False
    thread.start()
    return thread


def assert_cut_off_outputs(
    error: EngineDeadError, prompts: Sequence[str | list[int]], token_id: int
) -> None:
    """`error` carries one output per prompt, in order, each cut off with "error" after some
    tokens (all `token_id`), and naming the engine's death."""
    assert len(error.outputs) == len(prompts)
    for output, prompt in zip(error.outputs, prompts, strict=True):
        assert output.prompt == (prompt if isinstance(prompt, str) else None)
        assert output.finished and output.error == error.reason
        (completion,) = output.outputs
        assert completion.finish_reason == "error"
        assert completion.token_ids and set(completion.token_ids) == {token_id}
        assert output.num_generated_tokens == len(completion.token_ids)
