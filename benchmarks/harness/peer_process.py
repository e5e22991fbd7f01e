"""The parent side of a peer runner: a child program, run by the peer's own Python (its own
virtual environment), that the project talks to in JSON lines and never imports.

Protocol, one JSON object per line:
- the child is started as `<python> <runner> <request.json>`; the request file holds all it
  needs (model folder, dtype, the workloads by name, a warm-up workload);
- child -> parent, on stdout: `{"type": "ready", "version": ...}` once, after loading the model
  and running its own warm-up; then one `{"type": "result", "workload": name, "elapsed_s": s,
  "output_token_ids": [[...], ...]}` per command, outputs in prompt order;
  `{"type": "error", "message": ...}` instead of either when something fails;
- parent -> child, on stdin: `{"run": name}` per workload run; end of input asks it to exit.

The child's stderr (its logs) goes to a file whose tail comes with every error. Every wait is
bounded; the child leads its own process group, so closing it also ends whatever it started.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.common import GenerationWorkload, log_tail, stop_process

MESSAGE_TYPES = ("ready", "result", "error")
EXIT_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 1.0


class PeerError(RuntimeError):
    """A peer runner failed, broke the protocol, or did not answer in time."""


def parse_peer_message(line: str) -> dict:
    """One protocol line as a dict with a known "type"; PeerError for anything else, and for an
    error message (carrying the child's own message)."""
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PeerError(f"the peer printed a line that is not JSON: {line[:200]!r}") from exc
    if not isinstance(message, dict) or message.get("type") not in MESSAGE_TYPES:
        raise PeerError(
            f"the peer printed {line[:200]!r}; expected an object with type in {MESSAGE_TYPES}"
        )
    if message["type"] == "error":
        raise PeerError(f"the peer failed: {message.get('message', '(no message)')}")
    return message


def parse_run_result(message: dict, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
    """(seconds, output token ids per prompt) from a result message, checked against the
    workload: its name, one output per prompt, each exactly `max_tokens` long."""
    if message.get("type") != "result" or message.get("workload") != workload.name:
        raise PeerError(
            f"expected the result of workload {workload.name!r}, got {str(message)[:200]}"
        )
    elapsed_s = message.get("elapsed_s")
    token_ids = message.get("output_token_ids")
    if not isinstance(elapsed_s, (int, float)) or elapsed_s <= 0:
        raise PeerError(f"elapsed_s must be a positive number of seconds, got {elapsed_s!r}")
    if not isinstance(token_ids, list) or len(token_ids) != workload.num_prompts:
        num_outputs = len(token_ids) if isinstance(token_ids, list) else token_ids
        raise PeerError(
            f"the peer returned {num_outputs} outputs for the {workload.num_prompts} prompts of "
            f"{workload.name!r}"
        )
    for index, (tokens, max_tokens) in enumerate(zip(token_ids, workload.max_tokens, strict=True)):
        if not isinstance(tokens, list) or len(tokens) != max_tokens:
            length = len(tokens) if isinstance(tokens, list) else tokens
            raise PeerError(
                f"the peer returned {length} tokens for prompt {index} of {workload.name!r}, "
                f"asked {max_tokens} (ignore_eos)"
            )
    return float(elapsed_s), token_ids


class PeerProcess:
    """A running peer runner: `start` waits for its ready message, `request` sends one command
    and waits for its answer, `close` ends it (end of input, then signals)."""

    def __init__(
        self,
        argv: Sequence[str],
        name: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log_file = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self._process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log_file, text=True, start_new_session=True,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self, timeout_s: float) -> dict:
        """The ready message; PeerError if another message, an exit or `timeout_s` comes first."""
        message = self._next_message(timeout_s, "start")
        if message["type"] != "ready":
            raise PeerError(f"{self.name} sent {str(message)[:200]} before it was ready")
        return message

    def request(self, command: dict, timeout_s: float) -> dict:
        """Sends `command` and returns the next message (PeerError for an error message)."""
        try:
            self._process.stdin.write(json.dumps(command) + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise PeerError(
                f"{self.name} no longer reads its input ({exc})" + self._tail()
            ) from exc
        return self._next_message(timeout_s, f"answer {command}")

    def close(self) -> None:
        """Asks the child to exit (end of input), waits EXIT_TIMEOUT_S, then signals its group."""
        if self._process.stdin and not self._process.stdin.closed:
            with contextlib.suppress(OSError):  # it already exited with input unread
                self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=EXIT_TIMEOUT_S)
        stop_process(self._process, own_session=True)
        self._log_file.close()

    def _read_lines(self) -> None:
        for line in self._process.stdout:
            if line.strip():
                self._lines.put(line)
        self._lines.put(None)

    def _next_message(self, timeout_s: float, waiting_for: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerError(
                    f"{self.name} did not {waiting_for} within {timeout_s:.0f} s" + self._tail()
                )
            try:
                line = self._lines.get(timeout=min(remaining, POLL_INTERVAL_S))
            except queue.Empty:
                continue
            if line is None:
                code = self._process.wait()
                raise PeerError(f"{self.name} exited with code {code}" + self._tail())
            try:
                return parse_peer_message(line)
            except PeerError as exc:
                raise PeerError(f"{self.name}: {exc}" + self._tail()) from exc

    def _tail(self) -> str:
        self._log_file.flush()
        return log_tail(self.log_path)
