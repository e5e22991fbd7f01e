"""Keeping the process tree tidy: children leave with their parent, stops are bounded."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PARENT_POLL_INTERVAL_S = 0.5


def exit_when_orphaned(
    parent_pid: int, grace_s: float, on_orphaned: Callable[[], None] = lambda: None
) -> threading.Thread:
    """Starts a daemon thread that, once `parent_pid` stops being our parent (it died and we
    were re-parented), calls `on_orphaned()`, sends this process SIGTERM for a clean shutdown
    and hard-exits if it is still alive `grace_s` later. No child outlives its parent by more
    than that."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_INTERVAL_S)
        try:
            on_orphaned()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def exit_when_disconnected(fd: int, grace_s: float, what: str) -> threading.Event:
    """Starts a daemon thread that, once the stream socket `fd` reports its peer gone (closed,
    reset, or a TCP keepalive timeout), logs that `what` is gone, sends this process SIGTERM and
    hard-exits if it is still alive `grace_s` later: `exit_when_orphaned` for a process whose
    parent is at the other end of a connection. It never reads, so the owner keeps using `fd`.
    Set the returned event before closing `fd`; the watch then ends."""
    stopped = threading.Event()
    gone_events = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, gone_events)
        while True:
            events = poller.poll(PARENT_POLL_INTERVAL_S * 1000)
            if stopped.is_set() or any(e & select.POLLNVAL for _, e in events):
                return
            if any(e & gone_events for _, e in events):
                break
        logger.warning("%s is gone; exiting", what)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="link-watch", daemon=True).start()
    return stopped


def stop_process(process: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL; always reaps. Returns the exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "process %d ignored SIGTERM for %s s; killing it", process.pid, timeout_s
            )
            process.kill()
    return process.wait()


def describe_exit(returncode: int) -> str:
    """`returncode` as a person reads it: "exit code 1" or "signal SIGKILL"."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def python_module_command(module: str) -> list[str]:
    """The command that runs `python -m module` in a child process with a safe import path
    (`-P`, Python 3.11+): the current folder is not put first on sys.path, so nothing in it
    (a `core_engine/` folder of the user's) shadows the engine's packages."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", module]
