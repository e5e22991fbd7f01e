"""Attach: one engine core started by hand (`python -m core_engine.core --frontend-address ADDR`) serves
one client after another; a client with no core at its address says so in time.

The end-to-end tests start their own core (the NullWorker, or the default model where the
text matters) with its log in a file, and stop it at the end.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from core_engine.common.ports import find_free_port_pair
from core_engine.core.client_watch import ClientEvent, ClientWatch
from core_engine.frontend import core_client
from core_engine.frontend.core_client import AsyncCoreClient, EngineCoreNotFoundError
from core_engine.proto import EngineCoreRequest, FinishReason, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.null_worker import NULL_TOKEN_ID
from tests.helpers.server_process import ServerProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CORE_READY_TIMEOUT_S = 120.0
# The clients' own bounds: a core that is already up greets a client in milliseconds.
CLIENT_CONFIG = EngineConfig(model="null", startup_timeout_s=5.0, shutdown_timeout_s=2.0)


class HandStartedCore:
    """`python -m core_engine.core --frontend-address ADDRESS ...` with its log (and its worker's) in a
    file; `wait_for_log` polls that file."""

    def __init__(self, address: str, log_path: Path, *flags: str) -> None:
        self.address = address
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "core_engine.core", "--frontend-address", address, *flags]
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, count: int = 1, timeout_s: float = 30.0) -> None:
        if not wait_until(lambda: self.log().count(text) >= count, timeout_s):
            raise AssertionError(f"{text!r} not logged {count} times:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture
def make_core(tmp_path) -> Iterator:
    cores: list[HandStartedCore] = []

    def make(address: str, *flags: str) -> HandStartedCore:
        core = HandStartedCore(address, tmp_path / f"core{len(cores)}.log", *flags)
        cores.append(core)
        core.wait_for_log("engine core ready", timeout_s=CORE_READY_TIMEOUT_S)
        return core

    yield make
    for core in cores:
        core.stop()


def frontend_address(transport: str, tmp_path: Path) -> str:
    if transport == "tcp":
        return f"tcp://127.0.0.1:{find_free_port_pair()}"
    return f"ipc://{tmp_path}/engine"


def request(request_id: str, max_tokens: int | None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def token_ids_of(client: AsyncCoreClient, request_id: str, max_tokens: int) -> list[int]:
    """The request's tokens, once it has finished with LENGTH."""
    queue = client.add_request(request(request_id, max_tokens))
    token_ids: list[int] = []
    while True:
        output = await asyncio.wait_for(queue.get(), 30)
        assert not isinstance(output, Exception), output
        token_ids += output.new_token_ids
        if output.finished:
            assert output.finish_reason == FinishReason.LENGTH
            return token_ids


# ---- clients in turn ---------------------------------------------------------------------


def test_client_watch_sees_each_client_arrive_and_depart_in_turn(tmp_path):
    """Two frontends bind one after another: ARRIVED, DEPARTED, ARRIVED, and `is_connected`
    follows; a core with no frontend sees nothing."""
    context = zmq.Context()
    address = f"ipc://{tmp_path}/requests"
    dealer = context.socket(zmq.DEALER)
    watch = ClientWatch(dealer)
    dealer.connect(address)

    def read_events(count: int, timeout_s: float = 10.0) -> list[ClientEvent]:
        """The events read until `count` have come or `timeout_s` has passed."""
        events: list[ClientEvent] = []
        deadline = time.monotonic() + timeout_s
        while len(events) < count and time.monotonic() < deadline:
            watch.monitor.poll(100)
            watch.read_events()
            events += watch.take_events()
        return events

    try:
        assert read_events(1, timeout_s=0.5) == [] and not watch.is_connected
        for _ in range(2):
            router = context.socket(zmq.ROUTER)
            router.bind(address)
            assert read_events(1) == [ClientEvent.ARRIVED]
            assert watch.is_connected
            router.close(linger=0)
            assert read_events(1) == [ClientEvent.DEPARTED]
            assert not watch.is_connected
    finally:
        watch.close()
        dealer.close(linger=0)
        context.term()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_one_core_serves_three_clients_one_after_another(transport, tmp_path, make_core):
    """Each client in turn is greeted, served and, when it stops, logged as departed; the core
    lives on for the next one."""
    core = make_core(frontend_address(transport, tmp_path), "--model", "null")

    async def session(index: int) -> list[int]:
        client = AsyncCoreClient(CLIENT_CONFIG, core.address, launch_core=False)
        try:
            await client.start()
            return await token_ids_of(client, f"client-{index}", max_tokens=3 + index)
        finally:
            await client.shutdown()

    for index in range(3):
        assert asyncio.run(session(index)) == [NULL_TOKEN_ID] * (3 + index)
    core.wait_for_log(f"the frontend client at {core.address} departed", count=3)
    assert core.log().count(f"a frontend client connected at {core.address}") == 3
    assert core.process.poll() is None


def test_core_serve_restarted_on_a_core_with_the_default_model_completes_the_same(
    tmp_path, make_core
):
    """The issue's case: core-serve attached, stopped with Ctrl-C, started again: the second
    one is served, with the same greedy completion of the default model."""
    flags = ["--max-model-len", "512", "--num-gpu-blocks-override", "64"]
    core = make_core(f"tcp://127.0.0.1:{find_free_port_pair()}", *flags)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    texts = []
    for index in range(2):
        server = ServerProcess(
            ["--frontend-address", core.address, "--disable-log-stats"],
            tmp_path / f"core-serve{index}.log",
        )
        try:
            server.wait_ready(timeout_s=60)
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
            texts.append(response.json()["choices"][0]["text"])
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(30) == 0, server.log_tail()
        finally:
            server.stop()
    assert texts[0] and texts[1] == texts[0]
    core.wait_for_log(f"the frontend client at {core.address} departed", count=2)
    assert core.process.poll() is None


# ---- a client that dies ------------------------------------------------------------------

DOOMED_CLIENT = """
import asyncio, sys
from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.proto import EngineCoreRequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig

async def main():
    client = AsyncCoreClient(EngineConfig(model="null"), sys.argv[1], launch_core=False)
    await client.start()
    params = SamplingParams(max_tokens=None)  # up to max_model_len: it runs until killed
    queue = client.add_request(EngineCoreRequest("doomed", [1, 2, 3], params))
    await queue.get()
    stats = await client.get_stats()
    print(stats.num_running_reqs, stats.kv_cache_usage > 0, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


def test_a_client_killed_mid_request_is_forgotten_and_the_next_one_is_served(tmp_path, make_core):
    # Room for ~100k null tokens: the doomed request runs until the client is killed.
    flags = ["--model", "null", "--max-model-len", "100000", "--max-num-seqs", "8"]
    core = make_core(f"tcp://127.0.0.1:{find_free_port_pair()}", *flags)
    doomed = subprocess.Popen(
        [sys.executable, "-c", DOOMED_CLIENT, core.address], stdout=subprocess.PIPE, text=True
    )
    try:
        # Its request runs and holds KV blocks when it dies.
        assert doomed.stdout.readline().split() == ["1", "True"]
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
    finally:
        doomed.kill()
        doomed.wait()
    core.wait_for_log(
        f"the frontend client at {core.address} departed: aborted 1 request it had in flight "
        "(KV blocks freed)"
    )

    async def next_client() -> None:
        client = AsyncCoreClient(CLIENT_CONFIG, core.address, launch_core=False)
        try:
            await client.start()
            stats = await client.get_stats()
            assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
            assert stats.kv_cache_usage == 0.0
            assert await token_ids_of(client, "next", max_tokens=4) == [NULL_TOKEN_ID] * 4
        finally:
            await client.shutdown()

    asyncio.run(next_client())
    assert core.process.poll() is None


# ---- no core at the address --------------------------------------------------------------


def test_a_client_with_no_core_at_its_address_warns_then_fails_naming_it(
    monkeypatch, caplog, tmp_path
):
    monkeypatch.setattr(core_client, "NO_CORE_WARNING_S", 0.5)
    address = f"tcp://127.0.0.1:{find_free_port_pair()}"
    config = EngineConfig(model="null", startup_timeout_s=2.0, shutdown_timeout_s=1.0)
    client = AsyncCoreClient(config, address, launch_core=False)
    started_at = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger=core_client.__name__),
        pytest.raises(EngineCoreNotFoundError) as error,
    ):
        asyncio.run(client.start())
    waited_s = time.monotonic() - started_at
    command = f"python -m core_engine.core --frontend-address {address}"
    assert f"no engine core connected to {address} within startup_timeout_s=2 s" in str(error.value)
    assert command in str(error.value)
    # Not 2 x startup_timeout_s + shutdown_timeout_s (5 s): a connected core would get that.
    assert 2.0 <= waited_s < 4.0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"no engine core has connected to {address}" in warning and command in warning


def test_core_serve_with_no_core_at_its_address_exits_with_one_clear_line(tmp_path):
    address = f"tcp://127.0.0.1:{find_free_port_pair()}"
    flags = ["--frontend-address", address, "--startup-timeout-s", "2", "--shutdown-timeout-s", "1"]
    server = ServerProcess(["--model", "null", "--disable-log-stats", *flags], tmp_path / "log")
    try:
        exit_code = server.process.wait(60)
    finally:
        server.stop()
    log = server.log_tail(100_000)
    assert exit_code == 3, log
    assert f"no engine core connected to {address} within startup_timeout_s=2 s" in log
    assert f"python -m core_engine.core --frontend-address {address}" in log
    assert "Traceback" not in log
