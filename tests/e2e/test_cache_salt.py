"""`cache_salt`: requests share prefix-cache entries only under the same salt (or none), in
`SamplingParams`, through `LLM.generate` and over HTTP on both endpoints. The hashing itself is
test_kv_cache_manager.py's and test_prefix_router.py's."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from core_engine.frontend.llm import LLM
from core_engine.proto import SamplingParams
from tests.helpers.server_process import ServerProcess

API_KEY = "test-key"
PROMPT = list(range(1, 41))  # two full blocks of 16: a hit holds 32 tokens


def test_sampling_params_refuse_an_empty_or_non_string_cache_salt():
    assert SamplingParams(cache_salt="tenant-a").cache_salt == "tenant-a"
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            SamplingParams(cache_salt=bad)
    wire = msgspec.msgpack.encode({"cache_salt": ""})
    with pytest.raises(msgspec.ValidationError, match="cache_salt must be a non-empty string"):
        msgspec.msgpack.decode(wire, type=SamplingParams)


def test_llm_generate_shares_cached_prefixes_only_within_one_salt():
    with LLM(model="null", max_model_len=256) as llm:

        def num_cached_tokens(salt: str | None) -> int:
            params = SamplingParams(max_tokens=1, cache_salt=salt)
            return llm.generate(PROMPT, params, use_tqdm=False)[0].num_cached_tokens

        salts = ["tenant-a", "tenant-a", "tenant-b", None, None, "tenant-b"]
        assert [num_cached_tokens(salt) for salt in salts] == [0, 32, 0, 0, 32, 32]


# ---- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server") / "core-serve.log"
    server = ServerProcess(
        ["--model", "null", "--api-key", API_KEY, "--max-model-len", "256"], log_path
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def prefix_cache_counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^core:prefix_cache_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match is not None, f"core:prefix_cache_{name}_total missing from /metrics"
    return float(match.group(1))


def test_prefix_cache_hits_over_http_stay_within_one_salt(server):
    def hits_of_one_completion(salt: str | None) -> tuple[float, float]:
        before = [prefix_cache_counter(server, name) for name in ("queries", "hits")]
        body = {"prompt": PROMPT, "max_tokens": 1}
        response = post(
            server, "/v1/completions", body | ({} if salt is None else {"cache_salt": salt})
        )
        assert response.status_code == 200, response.text
        after = [prefix_cache_counter(server, name) for name in ("queries", "hits")]
        return after[0] - before[0], after[1] - before[1]

    salts = ["tenant-a", "tenant-a", "tenant-b", None, None]
    assert [hits_of_one_completion(salt) for salt in salts] == [
        (40, 0),
        (40, 32),
        (40, 0),
        (40, 0),
        (40, 32),
    ]
    assert prefix_cache_counter(server, "preempted_queries") == 0


def test_an_empty_or_non_string_cache_salt_is_a_400_on_both_endpoints(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    completion = {"prompt": "hi", "max_tokens": 1}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for bad in ("", 5, ["a"]):
            response = post(server, path, body | {"cache_salt": bad})
            assert response.status_code == 400, (path, bad, response.text)
            error = response.json()["error"]
            assert error["param"] == "cache_salt", error
        assert "non-empty string" in post(server, path, body | {"cache_salt": ""}).text
        response = post(server, path, body | {"cache_salt": "tenant-a"})
        assert response.status_code == 200, response.text
