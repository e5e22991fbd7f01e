"""core-serve's process life cycle, with real processes: engine death (kill -9 of the worker or
the core) fails every in-flight request with a message and exits 1, or stays up answering 503
with --keep-alive-on-engine-death; SIGINT to the process group (a terminal's Ctrl-C) and SIGTERM
drain running requests, end the rest with "server is shutting down" and exit 0; a signal during
start-up stops it at once; a busy port fails before any engine starts; attaching to a core
started separately. Every stop leaves no process and no file behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core_engine.common.ports import find_free_port_pair
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.null_worker import NULL_TOKEN_ID
from tests.helpers.server_process import (
    STARTUP_TIMEOUT_S,
    ServerProcess,
    descendant_pids,
    is_alive,
    wait_until,
)

NULL_MAX_MODEL_LEN = 65536
# The null model streams a few thousand tokens a second here: this outlasts every wait below.
LONG_MAX_TOKENS = 60_000
ENGINE_DEATH_EXIT_BOUND_S = 10.0


@pytest.fixture()
def ipc_parent() -> Iterator[Path]:
    """The servers' TMPDIR, to check that they leave no file: short, as ipc socket paths must
    stay under 107 characters."""
    with tempfile.TemporaryDirectory(prefix="serve-", dir="/tmp") as name:
        yield Path(name)


def null_server(
    tmp_path: Path, ipc_parent: Path, *args: str, new_session: bool = False
) -> ServerProcess:
    server = ServerProcess(
        [
            "--model", "null",
            "--disable-log-stats",
            "--max-model-len", str(NULL_MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "8192",
            *args,
        ],
        tmp_path / "core-serve.log",
        env={"TMPDIR": str(ipc_parent)},
        new_session=new_session,
    )  # fmt: skip
    server.wait_ready()
    return server


def engine_pid(server: ServerProcess, module: str) -> int:
    """The pid of core-serve's `python -m core_engine.core` or `python -m core_engine.worker` descendant."""
    (pid,) = [
        pid
        for pid in descendant_pids(server.process.pid)
        if f"core_engine.{module}".encode()
        in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]
    return pid


class StreamReader(threading.Thread):
    """Reads one streamed completion on a thread; `first_chunk` is set once one has arrived."""

    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{server.base_url}/v1/completions"
        self.body = {"prompt": "x", "max_tokens": max_tokens, "stream": True}
        self.first_chunk = threading.Event()
        self.events: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=60) as stream:
            for line in stream.iter_lines():
                if line:
                    self.events.append(line.removeprefix("data: "))
                    self.first_chunk.set()

    def is_done(self) -> bool:
        return self.events[-1:] == ["[DONE]"]

    def error(self) -> dict:
        """The error event just before [DONE]."""
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])["error"]

    def finish_reasons(self) -> list[str | None]:
        return [
            choice["finish_reason"]
            for event in self.events[:-1]
            for choice in json.loads(event).get("choices", [])
        ]


def start_streams(server: ServerProcess, *max_tokens: int) -> list[StreamReader]:
    readers = [StreamReader(server, n) for n in max_tokens]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.first_chunk.wait(30), server.log_tail()
    return readers


def assert_nothing_left(pids: set[int], ipc_parent: Path) -> None:
    assert wait_until(lambda: not any(is_alive(pid) for pid in pids), 10.0)
    assert list(ipc_parent.iterdir()) == []


@pytest.mark.parametrize("victim", ["worker", "core"])
def test_engine_death_fails_in_flight_requests_with_the_reason_and_exits_1(
    victim, tmp_path, ipc_parent
):
    server = null_server(tmp_path, ipc_parent)
    pids = descendant_pids(server.process.pid)
    try:
        (stream,) = start_streams(server, LONG_MAX_TOKENS)
        # A non-streamed request in flight too.
        body = {"prompt": "x", "max_tokens": LONG_MAX_TOKENS}
        answers: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            )
        )
        waiter.start()
        assert wait_until(lambda: _num_requests_running(server) == 2, 10.0)
        os.kill(engine_pid(server, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        exit_code = server.process.wait(ENGINE_DEATH_EXIT_BOUND_S)
        assert time.monotonic() - killed_at < ENGINE_DEATH_EXIT_BOUND_S
        stream.join(10)
        waiter.join(10)
    finally:
        server.stop()
    assert exit_code == 1, server.log_tail()
    # The stream ends with an error event naming the cause, then [DONE].
    error = stream.error()
    assert "SIGKILL" in error["message"], error
    assert error["code"] == "engine_dead"  # whichever process died: the engine did
    (answer,) = answers
    assert answer.status_code == 503 and "SIGKILL" in answer.json()["error"]["message"]
    assert "exiting so that a supervisor restarts it" in server.log_tail()
    assert_nothing_left(pids, ipc_parent)


def test_keep_alive_on_engine_death_answers_503_and_reaps_the_dead_core(tmp_path, ipc_parent):
    server = null_server(tmp_path, ipc_parent, "--keep-alive-on-engine-death")
    pids = descendant_pids(server.process.pid)
    try:
        core_pid = engine_pid(server, "core")
        (stream,) = start_streams(server, LONG_MAX_TOKENS)
        os.kill(engine_pid(server, "worker"), signal.SIGKILL)
        stream.join(10)
        assert "SIGKILL" in stream.error()["message"]
        assert wait_until(
            lambda: httpx.get(f"{server.base_url}/health").status_code == 503, 10.0
        ), server.log_tail()
        error = httpx.get(f"{server.base_url}/health").json()["error"]
        assert error["code"] == "engine_dead" and "SIGKILL" in error["message"]
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        # Reaped: no zombie left in the process table while core-serve lives on.
        assert wait_until(lambda: not Path(f"/proc/{core_pid}").exists(), 10.0)
        assert server.process.poll() is None
    finally:
        exit_code = server.stop()
    assert exit_code == 0, server.log_tail()
    assert_nothing_left(pids, ipc_parent)


def test_ctrl_c_drains_running_streams_then_ends_the_rest_and_exits_0(tmp_path, ipc_parent):
    """The short request takes about 10 s at the null model's speed, measured beside the long
    one (the speed varies several fold between machines and with load, so the margins are wide
    both ways): still running when the signal comes, done well within the drain. The long one
    could not finish in many drains."""
    drain_s = 40.0
    server = null_server(
        tmp_path,
        ipc_parent,
        "--shutdown-timeout-s", str(drain_s),
        "--max-model-len", "1000000",
        "--num-gpu-blocks-override", "65536",
        new_session=True,
    )  # fmt: skip
    pids = descendant_pids(server.process.pid)
    try:
        (long,) = start_streams(server, 900_000)
        tokens_per_s = _null_tokens_per_s(server)  # beside the long one, as the short one runs
        short_tokens = max(4000, int(10.0 * tokens_per_s))
        (short,) = start_streams(server, short_tokens)
        both_run = wait_until(lambda: short.is_done() or _num_requests_running(server) == 2, 30.0)
        # The premise: the short one is still streaming when the signal comes.
        speeds = f"{tokens_per_s:.0f} tokens/s measured, short {short_tokens} tokens"
        assert both_run and not short.is_done(), (
            f"{speeds}; {short.events[-2:]}; {server.log_tail()}"
        )
        # As a terminal does: the whole foreground process group gets SIGINT.
        os.killpg(server.process.pid, signal.SIGINT)
        signalled_at = time.monotonic()
        # No new connection is accepted.
        assert wait_until(lambda: not _accepts_connections(server), 2.0)
        short.join(30)
        long.join(drain_s + 15)
        exit_code = server.process.wait(drain_s + 15)
        stopped_s = time.monotonic() - signalled_at
    finally:
        server.stop()
    assert exit_code == 0, server.log_tail()
    # The short request finished during the drain; the long one got the drain's time, then
    # an error event.
    assert short.finish_reasons()[-1] == "length" and short.events[-1] == "[DONE]"
    assert long.error() == {
        "message": "server is shutting down",
        "type": "service_unavailable",
        "param": None,
        "code": "shutting_down",
    }
    assert drain_s <= stopped_s < drain_s + 15
    log = server.log_tail(200_000)
    assert re.search(r"SIGINT received: .*; 2 running requests get up to", log), (speeds, log)
    # INFO only: no process had to be killed, nothing failed.
    assert "WARNING" not in log and "ERROR" not in log and "Traceback" not in log
    assert_nothing_left(pids, ipc_parent)


def test_sigterm_when_idle_exits_0_at_once_without_leftovers(tmp_path, ipc_parent):
    server = null_server(tmp_path, ipc_parent)
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 200
    pids = descendant_pids(server.process.pid)
    assert len(pids) >= 2, "expected the engine core and its worker"
    assert len(list(ipc_parent.iterdir())) == 1, "expected the private ipc directory"
    started_at = time.monotonic()
    exit_code = server.stop()
    assert exit_code == 0, server.log_tail()
    assert time.monotonic() - started_at < 5.0  # nothing to drain: no wait
    log = server.log_tail(100_000)
    assert "Application shutdown complete" in log
    assert "ERROR" not in log and "Traceback" not in log
    assert_nothing_left(pids, ipc_parent)


def test_a_signal_during_start_up_stops_it_without_waiting_for_the_model(tmp_path, ipc_parent):
    server = ServerProcess(
        ["--max-model-len", "512", "--num-gpu-blocks-override", "64", "--disable-log-stats"],
        tmp_path / "core-serve.log",
        env={"TMPDIR": str(ipc_parent)},
    )
    try:
        assert wait_until(lambda: "started worker rank 0" in server.log_tail(), 60.0)
        pids = descendant_pids(server.process.pid)
        server.process.send_signal(signal.SIGTERM)
        exit_code = server.process.wait(30)
    finally:
        server.stop()
    assert exit_code == 0, server.log_tail()
    log = server.log_tail(100_000)
    assert "SIGTERM received during start-up" in log, log
    assert "serving SmolLM2" not in log and "Traceback" not in log
    assert_nothing_left(pids, ipc_parent)


def _null_tokens_per_s(server: ServerProcess, num_tokens: int = 4000) -> float:
    """How fast this server generates null tokens, the faster of two requests of `num_tokens`:
    a fresh server's first request also pays its warm-up, and under load a request sized by
    that alone could end before it was seen running."""
    return max(_null_request_tokens_per_s(server, num_tokens) for _ in range(2))


def _null_request_tokens_per_s(server: ServerProcess, num_tokens: int) -> float:
    started = time.monotonic()
    body = {"prompt": "x", "max_tokens": num_tokens}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.json()["usage"]["completion_tokens"] == num_tokens
    return num_tokens / (time.monotonic() - started)


def _num_requests_running(server: ServerProcess) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(r"^core:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def _accepts_connections(server: ServerProcess) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=1.0):
            return True
    except OSError:
        return False


def test_a_busy_port_fails_at_once_naming_it_before_any_engine_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "core_engine.frontend.openai.cli",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    # The default model was never loaded: no engine core was started.
    assert "engine core" not in result.stderr and "Traceback" not in result.stderr


def test_core_serve_attaches_to_a_separately_started_core_and_starts_none(tmp_path):
    """`core-serve --frontend-address ADDR` waits for `python -m core_engine.core --frontend-address ADDR`:
    that core's one worker serves the requests, and core-serve starts no engine of its own."""
    address = f"ipc://{tmp_path}/engine"
    core = subprocess.Popen(
        [sys.executable, "-m", "core_engine.core", "--frontend-address", address, "--model", "null"]
    )
    server = ServerProcess(
        ["--model", "null", "--frontend-address", address, "--disable-log-stats"],
        tmp_path / "log",
    )
    try:
        server.wait_ready()
        assert descendant_pids(server.process.pid) == set()  # no core of its own
        workers = descendant_pids(core.pid)
        assert len(workers) == 1
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        assert descendant_pids(core.pid) == workers
    finally:
        server.stop()
        core.terminate()
        core.wait(30)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_engine_clients_attach_to_a_separately_started_core_and_start_none(transport, tmp_path):
    """EngineClient over tcp, AsyncEngineClient over ipc: the separately started core's one
    worker serves, and this process gains no engine process of its own."""
    from core_engine.frontend import AsyncEngineClient, EngineClient, SamplingParams

    if transport == "tcp":
        address = f"tcp://127.0.0.1:{find_free_port_pair()}"
    else:
        address = f"ipc://{tmp_path}/engine"
    children_before = descendant_pids(os.getpid())
    core = subprocess.Popen(
        [sys.executable, "-m", "core_engine.core", "--frontend-address", address, "--model", "null"]
    )
    # The client's own config differs: the attached core's settings are the ones that count.
    config = EngineConfig(model="null", max_model_len=64)
    params = SamplingParams(max_tokens=3)
    try:
        if transport == "tcp":
            with EngineClient(config, address) as client:
                (final,) = client.generate("hi", params, stream=False)
                max_model_len = client.max_model_len
                engine_pids = descendant_pids(os.getpid()) - children_before
        else:

            async def run_async() -> tuple:
                async with AsyncEngineClient(config, address) as client:
                    outputs = [o async for o in client.generate("hi", params, stream=False)]
                    return outputs[0], client.max_model_len, descendant_pids(os.getpid())

            final, max_model_len, pids = asyncio.run(run_async())
            engine_pids = pids - children_before
        workers = descendant_pids(core.pid)
        assert len(workers) == 1
        assert engine_pids == {core.pid} | workers  # nothing but the separate core's tree
        assert final.outputs[0].token_ids == [NULL_TOKEN_ID] * 3
        assert max_model_len != 64  # the core's own default, not the client's config
        assert core.poll() is None  # the client leaves the core it attached to running
    finally:
        core.terminate()
        core.wait(30)


def test_attaching_to_an_address_where_no_core_answers_fails_in_time(tmp_path):
    from core_engine.frontend import EngineClient

    config = EngineConfig(model="null", startup_timeout_s=2.0)
    start = time.monotonic()
    # No core ever connected: bounded by startup_timeout_s alone, not by a core's start-up budget.
    with pytest.raises(TimeoutError, match="no engine core connected to ipc://.*/nobody within"):
        EngineClient(config, f"ipc://{tmp_path}/nobody")
    assert time.monotonic() - start < 2.0 + 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The default SmolLM2 has 9 attention heads: found by the workers.
        (
            ["--tensor-parallel-size", "2"],
            "tensor_parallel_size=2 does not divide the model's num_attention_heads=9; "
            "choose one of 1, 3, 9",
        ),
        # Found by the core, sizing its KV pool.
        (
            ["--model", "null", "--num-gpu-blocks-override", "2", "--max-model-len", "4096"],
            "num_gpu_blocks=2 cannot hold one request of max_model_len=4096 tokens",
        ),
    ],
)
def test_a_setting_the_engine_cannot_run_with_is_one_line_and_exit_code_2(args, message, tmp_path):
    server = ServerProcess(args, tmp_path / "log")
    try:
        exit_code = server.process.wait(STARTUP_TIMEOUT_S)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert exit_code == 2, log
    (error_line,) = [line for line in log.splitlines() if " ERROR " in line or "ERROR:" in line]
    assert "the engine cannot run with these settings: " in error_line and message in error_line
    assert "Traceback" not in log
