"""/metrics counts every request that ends exactly once, by how it ended (stop, length, abort,
error), whoever ended it: the engine core, a stop string found in the frontend, a client that
disconnected, a dead engine. Real `core-serve` processes on the null model ("*" every step)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core_engine.frontend.metrics import FINISHED_REASONS
from tests.helpers.server_process import ServerProcess, descendant_pids, wait_until

NULL_ARGS = ["--model", "null", "--max-model-len", "65536", "--num-gpu-blocks-override", "8192"]
LONG_MAX_TOKENS = 60_000  # many seconds of null tokens: only an abort or a death ends it


def finished_counts(server: ServerProcess) -> dict[str, float]:
    """`core:request_success_total` by finished reason, plus the end-to-end latency count."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counts = {}
    for reason in FINISHED_REASONS:
        pattern = rf'^core:request_success_total{{finished_reason="{reason}",[^}}]*}} (\S+)$'
        counts[reason] = float(re.search(pattern, text, re.MULTILINE).group(1))
    match = re.search(r"^core:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    counts["e2e_latency"] = float(match.group(1))
    return counts


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before if after[name] != before[name]}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = ServerProcess(NULL_ARGS, tmp_path_factory.mktemp("metrics") / "core-serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def complete(server: ServerProcess, **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_stop_string_found_in_the_frontend_counts_as_stop_once(server):
    before = finished_counts(server)
    answer = complete(server, prompt="x", n=2, max_tokens=50, min_tokens=3, stop=["**"])
    assert [choice["finish_reason"] for choice in answer["choices"]] == ["stop", "stop"]
    # The core's answers to the aborts that follow a stop string count for nothing: by the
    # time a later request has finished, they have arrived.
    answer = complete(server, prompt="x", max_tokens=3)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert increase(before, finished_counts(server)) == {"stop": 2, "length": 1, "e2e_latency": 3}


def test_a_streamed_stop_string_counts_as_stop_once(server):
    before = finished_counts(server)
    body = {"prompt": "x", "max_tokens": 50, "stop": ["*"], "stream": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert '"finish_reason":"stop"' in response.text
    complete(server, prompt="x", max_tokens=1)
    assert increase(before, finished_counts(server)) == {"stop": 1, "length": 1, "e2e_latency": 2}


def test_clients_that_leave_count_as_abort_once(server):
    before = finished_counts(server)
    body = {"prompt": "x", "max_tokens": LONG_MAX_TOKENS, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream,
    ):
        next(line for line in stream.iter_lines() if line)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request left before its answer
        httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=1)
    expected = {"abort": 2, "e2e_latency": 2}
    assert wait_until(lambda: increase(before, finished_counts(server)) == expected, 10.0), (
        increase(before, finished_counts(server))
    )


def engine_worker_pid(server: ServerProcess) -> int:
    (pid,) = [
        pid
        for pid in descendant_pids(server.process.pid)
        if b"core_engine.worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]
    return pid


def test_requests_the_dead_engine_failed_count_as_error_and_metrics_still_answer(tmp_path):
    server = ServerProcess([*NULL_ARGS, "--keep-alive-on-engine-death"], tmp_path / "log")
    try:
        server.wait_ready()
        before = finished_counts(server)
        body = {"prompt": "x", "n": 2, "max_tokens": LONG_MAX_TOKENS, "stream": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream,
        ):
            lines = (line for line in stream.iter_lines() if line)
            next(lines)
            os.kill(engine_worker_pid(server), signal.SIGKILL)
            events = list(lines)
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 503)
        response = httpx.get(f"{server.base_url}/metrics")
        assert response.status_code == 200
        assert increase(before, finished_counts(server)) == {"error": 2, "e2e_latency": 2}
    finally:
        server.stop()
