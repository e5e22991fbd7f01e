"""Prefill/decode disaggregation with real processes: a prefill instance (TcpConnector
kv_producer) and a decode instance (kv_consumer) of the default model, and `core-pd-proxy` in
front. Greedy answers through the proxy, streamed or not, equal one instance's; the decode
instance really pulled the prompt's KV; a prefill instance killed before the pull leaves the
decode instance to compute the prompt itself, with the same answer.

The single-instance reference is the decode instance itself, asked with a `cache_salt` so that
it computes the whole prompt (a salt changes which blocks match, never what the model says)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from core_engine.common.ports import find_free_port
from tests.helpers.server_process import ServerProcess, descendant_pids, wait_until

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
ENGINE_FLAGS = [
    "--device", "cpu",
    "--dtype", "float32",
    "--max-model-len", "512",
    "--num-gpu-blocks-override", "64",
    "--block-size", str(BLOCK_SIZE),
    "--disable-log-stats",
]  # fmt: skip
PROMPT = (
    "The history of paged memory begins with the Atlas computer at the University of "
    "Manchester, which moved pages between core memory and a drum so that programs saw one "
    "large address space. Decades later the same idea organises the key and value cache of "
    "language models into fixed blocks. Explain in one paragraph why"
)
# Shares no block with PROMPT: the decode instance has none of it cached when it pulls.
OTHER_PROMPT = (
    "Write a short letter to a lighthouse keeper who has kept the same lamp burning for forty "
    "years, thanking them for every ship that reached the harbour safely in the storms of the "
    "northern winter, and ask"
)
COMPLETION = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
CHAT = {
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
}


def tcp_config(role: str) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role})


class Proxy:
    def __init__(self, prefill_url: str, decode_url: str, log_path) -> None:
        self.port = find_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "core_engine.frontend.openai.pd_proxy_cli",
                "--prefill", prefill_url, "--decode", decode_url,
                "--host", "127.0.0.1", "--port", str(self.port),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="module")
def instances(tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess, Proxy]]:
    logs = tmp_path_factory.mktemp("pd")
    prefill = ServerProcess(
        [*ENGINE_FLAGS, "--kv-transfer-config", tcp_config("kv_producer")], logs / "prefill.log"
    )
    decode = ServerProcess(
        [*ENGINE_FLAGS, "--kv-transfer-config", tcp_config("kv_consumer")], logs / "decode.log"
    )
    proxy = Proxy(prefill.base_url, decode.base_url, logs / "proxy.log")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        assert wait_until(proxy.ready, 30.0), (logs / "proxy.log").read_text()
        yield prefill, decode, proxy
    finally:
        proxy.stop()
        for server in (prefill, decode):
            kill_tree(server)
            server.stop()  # closes its log


def kill_tree(server: ServerProcess) -> None:
    """SIGKILL to the server and every process below it (its engine core and worker)."""
    pids = descendant_pids(server.process.pid) | {server.process.pid}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def post(base_url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def counter(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^core:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"core:{name} missing from /metrics"
    return float(match.group(1))


def pulled_tokens(num_tokens: int) -> int:
    """Full blocks before the last prompt token: what the decode instance pulls."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_greedy_completions_through_the_proxy_equal_one_instance_and_pull_the_prompt(instances):
    prefill, decode, proxy = instances
    reference = post(decode.base_url, "/v1/completions", {**COMPLETION, "cache_salt": "ref"})
    hits_before = counter(decode.base_url, "external_prefix_cache_hits_total")
    loaded_before = counter(decode.base_url, "kv_offload_loaded_bytes_total")
    prefill_prompts_before = counter(prefill.base_url, "prompt_tokens_total")
    routed = post(proxy.base_url, "/v1/completions", COMPLETION)
    assert routed["choices"][0]["text"] == reference["choices"][0]["text"]
    assert routed["usage"]["completion_tokens"] == 16
    num_tokens = routed["usage"]["prompt_tokens"]
    assert num_tokens > 2 * BLOCK_SIZE
    assert counter(prefill.base_url, "prompt_tokens_total") - prefill_prompts_before == num_tokens
    hits = counter(decode.base_url, "external_prefix_cache_hits_total") - hits_before
    assert hits == pulled_tokens(num_tokens)
    assert counter(decode.base_url, "kv_offload_loaded_bytes_total") > loaded_before
    # The producer freed the pulled blocks once released: its pool is empty again.
    assert wait_until(lambda: counter(prefill.base_url, "kv_cache_usage_perc") == 0.0)


def test_a_streamed_chat_through_the_proxy_equals_one_instance(instances):
    _, decode, proxy = instances
    reference = post(decode.base_url, "/v1/chat/completions", {**CHAT, "cache_salt": "ref"})
    text = ""
    with httpx.stream(
        "POST", f"{proxy.base_url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            text += choice["delta"].get("content") or ""
    assert len(lines) > 3  # token by token, not one block
    assert text == reference["choices"][0]["message"]["content"]


def test_the_prefill_answer_carries_where_to_pull_and_a_dead_prefill_means_recompute(instances):
    """Last in this module: it kills the prefill instance."""
    prefill, decode, _ = instances
    body = {**COMPLETION, "prompt": OTHER_PROMPT}
    reference = post(decode.base_url, "/v1/completions", {**body, "cache_salt": "ref"})
    answer = post(
        prefill.base_url,
        "/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = answer["kv_transfer_params"]
    num_tokens = answer["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"]) == num_tokens // BLOCK_SIZE
    assert len(params["remote_block_hashes"]) == num_tokens // BLOCK_SIZE
    kill_tree(prefill)
    hits_before = counter(decode.base_url, "external_prefix_cache_hits_total")
    loaded_before = counter(decode.base_url, "kv_offload_loaded_bytes_total")
    recomputed = post(decode.base_url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert recomputed["choices"][0]["text"] == reference["choices"][0]["text"]
    # The pull was planned (counted as a hit) but failed: nothing was loaded, all computed.
    hits = counter(decode.base_url, "external_prefix_cache_hits_total") - hits_before
    assert hits == pulled_tokens(num_tokens)
    assert counter(decode.base_url, "kv_offload_loaded_bytes_total") == loaded_before
