"""core-serve end to end: a real server process, the official `openai` client and raw HTTP.

Most tests share one server on the null model (token 42, "*" in the byte tokenizer, every
step). Tests that kill or stop a server start their own; one compares the default SmolLM2
model's greedy output over HTTP with the in-process engine (core.in_process_engine).
The server's process life cycle (signals, engine death, ports, attaching) is
test_server_lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core_engine.frontend.openai.protocol.chat import ChatCompletionRequest
from core_engine.frontend.openai.protocol.completions import CompletionRequest
from core_engine.frontend.openai.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.server_process import ServerProcess, wait_until

API_KEY = "test-key"
MODEL_NAME = "null-model"
MODEL_ALIAS = "null-alias"  # a second --served-model-name
NULL_MAX_MODEL_LEN = 65536
TOKENIZER = NullTokenizer()
MAX_BODY_BYTES = 1_000_000
SMALL_KV_CACHE_NUM_BLOCKS = 64  # instead of a multi-GiB CPU KV cache per engine


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^core:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"metric core:{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server") / "core-serve.log"
    server = ServerProcess(
        [
            "--model", "null",
            "--served-model-name", MODEL_NAME, MODEL_ALIAS,
            "--api-key", API_KEY,
            "--max-request-body-bytes", str(MAX_BODY_BYTES),
            "--max-model-len", str(NULL_MAX_MODEL_LEN),
            "--max-num-seqs", "64",
            "--num-gpu-blocks-override", "8192",
        ],
        log_path,
    )  # fmt: skip
    yield from serving(server)


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def serving(server: ServerProcess) -> Iterator[ServerProcess]:
    """For fixtures: `server` once it answers /health, stopped when the fixture ends."""
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def post(server: ServerProcess, path: str, body: dict, key: str = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_completion(client):
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=7)
    (choice,) = response.choices
    assert choice.text == "*" * 7
    assert choice.finish_reason == "length"
    assert response.model == MODEL_NAME
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 7)
    assert response.usage.total_tokens == 12


def test_chat_completion(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "*****"
    assert choice.finish_reason == "length"
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}])
    assert response.usage.prompt_tokens == len(TOKENIZER.encode(prompt))
    assert response.usage.completion_tokens == 5


def test_streamed_completion(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content_chunks) == "*" * 9
    assert [c.choices[0].finish_reason for c in content_chunks] == [None] * 8 + ["length"]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (5, 9)


def test_streamed_chat_completion(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "****"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_is_server_sent_events_ending_in_done(server):
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        response = post(server, path, {**body, "max_tokens": 2, "stream": True})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert all(event.startswith("data: ") for event in events[:-1])
        for event in events[:-2]:
            json.loads(event.removeprefix("data: "))


def test_n_choices_batched_prompts_echo_and_stop(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt=["ab", "cde"], n=2, max_tokens=3, seed=5
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert all(c.text == "***" for c in response.choices)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 12)

    echoed = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "Hi**"

    stopped = client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=50, stop=["**"], extra_body={"min_tokens": 4}
    )
    assert stopped.choices[0].text == "**"
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 4


def test_vllm_sampling_fields_and_logprobs(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="x",
        max_tokens=3,
        logprobs=2,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [7]},
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == ["*"] * 3
    assert logprobs.text_offset == [0, 1, 2]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["*", "*"]
    assert all(len(entry.top_logprobs) == 3 for entry in content)


def test_64_concurrent_streams_complete_and_free_the_kv_cache(server):
    max_tokens = [1 + (i * 7) % 60 for i in range(64)]
    num_generated_before = metric(server.base_url, "generation_tokens_total")

    async def one_stream(client: openai.AsyncOpenAI, n: int) -> tuple[str, int, str | None]:
        text, finish_reason, usage = "", None, None
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"request with {n} tokens",
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.text
                finish_reason = choice.finish_reason or finish_reason
        return text, usage, finish_reason

    async def all_streams() -> list[tuple[str, int, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one_stream(client, n) for n in max_tokens))

    results = asyncio.run(all_streams())
    assert results == [("*" * n, n, "length") for n in max_tokens]
    assert metric(server.base_url, "generation_tokens_total") - num_generated_before == sum(
        max_tokens
    )
    assert metric(server.base_url, "num_requests_running") == 0
    assert metric(server.base_url, "num_requests_waiting") == 0
    assert metric(server.base_url, "kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "long"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long"}]}),
    ],
)
def test_every_chunk_of_a_stream_has_the_same_id_model_and_created(server, path, body):
    """A stream read for more than a second (60000 null tokens take far longer): `created` is
    the response's, fixed when it began, not each chunk's own time."""
    body = {**body, "model": MODEL_NAME, "max_tokens": 60000, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    began_s = time.time()
    chunks = []
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}{path}", json=body, headers=headers) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
            if time.time() - began_s > 2.5 and len(chunks) > 1:
                break
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert {chunk["model"] for chunk in chunks} == {MODEL_NAME}
    (created,) = {chunk["created"] for chunk in chunks}
    assert int(began_s) <= created <= int(began_s) + 1


def test_client_disconnect_mid_stream_aborts_the_request(server):
    # 60000 null tokens take many seconds: only an abort can free the blocks in time.
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 60000, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # The server is shared: earlier tests' requests may still be finishing under load.
    assert wait_until(lambda: metric(server.base_url, "num_requests_running") == 0, 30.0)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers) as r,
    ):
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(20), strict=False) if line]
        assert all(line.startswith("data: ") for line in received)
        assert metric(server.base_url, "num_requests_running") == 1
        assert metric(server.base_url, "kv_cache_usage_perc") > 0
    assert wait_until(lambda: metric(server.base_url, "num_requests_running") == 0, 10.0)
    assert metric(server.base_url, "kv_cache_usage_perc") == 0.0


def test_client_leaving_before_a_non_streamed_answer_aborts_the_request(server):
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 60000}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=1.0)
    assert wait_until(lambda: metric(server.base_url, "num_requests_running") == 0, 10.0)
    assert metric(server.base_url, "kv_cache_usage_perc") == 0.0
    # The handler is cancelled and answered quietly: no InvalidStateError traceback in the log.
    assert "InvalidStateError" not in server.log_tail(100_000)
    assert "Exception in ASGI application" not in server.log_tail(100_000)


def test_invalid_parameters_answer_400_naming_the_parameter(server):
    response = post(server, "/v1/completions", {"prompt": "abc", "max_tokens": NULL_MAX_MODEL_LEN})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "max_tokens"
    assert str(NULL_MAX_MODEL_LEN) in error["message"]
    assert f"at most {NULL_MAX_MODEL_LEN - 3}" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}

    for body, param in (
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"40000": 1}}, "logit_bias"),
        ({"prompt": "x", "min_tokens": 1, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "x", "top_k": 2**63}, "top_k"),
        ({"prompt": "x", "bad_words": ["ok", "  "]}, "bad_words"),
    ):
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, response.json()
    response = post(server, "/v1/chat/completions", {"messages": [], "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


def test_fields_not_implemented_answer_400_and_neutral_or_unknown_ones_work(server, client):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in (
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        # The null model has no vocabulary to constrain: said, not ignored.
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
    ):
        response = post(server, "/v1/chat/completions", {**chat, **extra})
        assert response.status_code == 400, extra
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"], error
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=chat["messages"],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        user="someone",
        extra_body={"use_beam_search": False, "a_field_nobody_knows": 1},
    )
    assert response.choices[0].finish_reason == "length"
    assert "ignored unknown field 'a_field_nobody_knows'" in server.log_tail(100_000)


def test_every_error_has_the_openai_shape(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for response, status in (
        (httpx.get(f"{server.base_url}/no/such/route", headers=headers), 404),
        (httpx.get(f"{server.base_url}/v1/completions", headers=headers), 405),
        (
            httpx.post(
                f"{server.base_url}/v1/completions",
                content=b"prompt=x",
                headers={**headers, "Content-Type": "application/x-www-form-urlencoded"},
            ),
            400,
        ),
    ):
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "must be JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            b'{"model": "x",\n "messages": [',
            "the request body is not valid JSON: Expecting value at line 2 column 15 (char 29)",
            None,
        ),
        (b"", "the request body is empty; send a JSON object", None),
        (b"[1, 2]", "the request body must be a JSON object, got an array", None),
        (b"null", "the request body must be a JSON object, got null", None),
        (b"{}", "messages: Field required", "messages"),
        (b'{"messages": 5}', "messages: Input should be a valid list", "messages"),
    ],
)
def test_a_body_that_is_not_a_json_object_says_so_and_a_field_error_names_the_field(
    server, body, message, param
):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    url = f"{server.base_url}/v1/chat/completions"
    response = httpx.post(url, content=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (message, param)


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10), "max_tokens": 1}).encode()
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_BYTES) in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"x" * 100_000

    response = httpx.post(f"{server.base_url}/v1/completions", content=chunks(), headers=headers)
    assert response.status_code == 413
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_bad_text_and_numbers_are_400_naming_what_is_wrong(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    url = f"{server.base_url}/v1/completions"
    surrogate = b'{"prompt": "a \\ud800 b", "max_tokens": 2}'
    response = httpx.post(url, content=surrogate, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert "not valid Unicode" in response.json()["error"]["message"]
    chat = b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}'
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=chat, headers=headers)
    assert (response.status_code, response.json()["error"]["param"]) == (
        400,
        "messages[0].content",
    )
    response = httpx.post(url, content=b'{"prompt": "x", "temperature": NaN}', headers=headers)
    assert response.status_code == 400 and "NaN" in response.json()["error"]["message"]
    for field, value in (("seed", 2**70), ("top_k", 2**70), ("stop_token_ids", [2**70])):
        response = post(server, "/v1/completions", {"prompt": "x", field: value})
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_model_card_version_tokenize_and_detokenize(server):
    response = httpx.get(
        f"{server.base_url}/v1/models/{MODEL_NAME}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 200 and response.json()["id"] == MODEL_NAME
    response = httpx.get(
        f"{server.base_url}/v1/models/other", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    tokens = post(server, "/tokenize", {"prompt": "héllo"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len("héllo".encode())
    assert tokens["max_model_len"] > 0
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    for path, body, param in (
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": []}, None),
    ):
        response = post(server, path, body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, response.json()
    response = httpx.post(
        f"{server.base_url}/tokenize",
        content=b'{"prompt": "\\ud800"}',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")
    assert post(server, "/tokenize", {"prompt": "x"}, key="wrong").status_code == 401


def test_bad_api_key_answers_401_and_unknown_model_404(server, client):
    with pytest.raises(openai.AuthenticationError) as auth_error:
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong").models.list()
    assert auth_error.value.status_code == 401
    assert auth_error.value.body["code"] == "invalid_api_key"
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 401

    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert not_found.value.body == {
        "message": (
            "The model `no-such-model` does not exist; this server serves "
            f"`{MODEL_NAME}`, `{MODEL_ALIAS}`"
        ),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_every_served_name_is_listed_and_served_and_answers_carry_the_first(client):
    assert [card.id for card in client.models.list().data] == [MODEL_NAME, MODEL_ALIAS]
    response = client.completions.create(model=MODEL_ALIAS, prompt="x", max_tokens=2)
    assert response.model == MODEL_NAME and response.choices[0].text == "**"
    chat = client.chat.completions.create(
        model=MODEL_ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert chat.model == MODEL_NAME


def test_models_health_and_metrics(server, client):
    card = client.models.list().data[0]
    assert card.id == MODEL_NAME
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    client.completions.create(model=MODEL_NAME, prompt="warm up the histograms", max_tokens=3)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert re.search(rf"^core:{name}\{{model_name=\"{MODEL_NAME}\"\}} ", text, re.M), name
    assert metric(server.base_url, "time_to_first_token_seconds_count") >= 1
    assert metric(server.base_url, "inter_token_latency_seconds_count") >= 2
    assert metric(server.base_url, "e2e_request_latency_seconds_count") >= 1
    assert metric(server.base_url, "request_queue_time_seconds_count") >= 1
    assert metric(server.base_url, "prefix_cache_queries_total") > 0
    assert re.search(
        rf'^core:request_success_total{{finished_reason="length",model_name="{MODEL_NAME}"}} ',
        text,
        re.M,
    )
    assert "# TYPE core:time_to_first_token_seconds histogram" in text


@pytest.mark.slow
def test_greedy_output_equals_the_in_process_engine(tmp_path):
    from tests.helpers.engine_helpers import generate

    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    max_tokens = 8
    reference = generate(
        prompts,
        EngineConfig(max_model_len=512, num_gpu_blocks_override=SMALL_KV_CACHE_NUM_BLOCKS),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    server = ServerProcess(
        [
            "--max-model-len", "512",
            "--num-gpu-blocks-override", str(SMALL_KV_CACHE_NUM_BLOCKS),
            "--disable-log-stats",
        ],
        tmp_path / "log",
    )  # fmt: skip
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        for prompt, expected in zip(prompts, reference.results, strict=True):
            response = client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens, temperature=0
            )
            assert response.choices[0].text == expected.text
            assert response.usage.completion_tokens == len(expected.token_ids)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """core-serve on the default model, with the hermes tool-call parser."""
    server = ServerProcess(
        [
            "--max-model-len", "512",
            "--num-gpu-blocks-override", str(SMALL_KV_CACHE_NUM_BLOCKS),
            "--disable-log-stats",
            "--tool-call-parser", "hermes",
        ],
        tmp_path_factory.mktemp("model-server") / "log",
    )  # fmt: skip
    yield from serving(server)


@pytest.mark.slow
def test_structured_outputs_over_http_with_n_and_streaming(model_server):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    client = openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Invent a person and give them as JSON."}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        n=2,
        seed=3,
        max_tokens=80,
        response_format=response_format,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    texts = ["", ""]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        n=2,
        max_tokens=80,
        stream=True,
        response_format=response_format,
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The answer is",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert completion.choices[0].text in ("yes", "no")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=5, response_format=bad
        )
    assert error.value.body["param"] == "response_format"
    assert "invalid JSON schema" in error.value.body["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.slow
def test_tool_calls_over_http_required_named_streamed_and_in_the_history(model_server):
    client = openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call-")
    assert set(json.loads(call.function.arguments)) == {"city"}

    named = {"type": "function", "function": {"name": "get_weather"}}
    arguments, names = "", []
    for chunk in client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice=named,
        max_tokens=60,
        temperature=0,
        stream=True,
    ):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            names.append(delta_call.function.name)
            arguments += delta_call.function.arguments or ""
    assert names[0] == "get_weather" and set(json.loads(arguments)) == {"city"}

    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    follow_up = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, max_tokens=8, temperature=0
    )
    assert follow_up.choices[0].message.content
    # "auto" needs a template that renders tools: SmolLM2's does not, which is said.
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER_TOOL], max_tokens=5
        )
    assert error.value.body["param"] == "tools"
    assert "does not render tools" in error.value.body["message"]


@pytest.mark.slow
def test_echo_logprobs_with_max_tokens_0_score_a_prompt_like_lm_eval(model_server):
    """lm-eval-harness's loglikelihood request: the prompt echoed with each token's logprob
    (the first None), nothing generated; equal to the engine's own prompt logprobs."""
    client = openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused")
    prompt = "The capital of France is Paris"
    scored = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = scored.choices
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    # The same numbers as vLLM's prompt_logprobs field, from the same engine pass.
    extra = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    prompt_logprobs = extra.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    by_position = [next(iter(entry.values()))["logprob"] for entry in prompt_logprobs[1:]]
    assert by_position == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"


# Every field of both endpoints, strings nested in objects and lists among them.
REQUEST_FIELDS = sorted(
    set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {"json"}
)
# Text with lone surrogates (which JSON's \\ud800 escapes carry) as often as any other.
TEXT = st.text(st.characters(exclude_categories=()) | st.sampled_from("\ud800\udfffa"), max_size=20)


def json_values():
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | TEXT
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(TEXT | st.sampled_from(REQUEST_FIELDS), children, max_size=4)
        ),
        max_leaves=12,
    )


VALID_BODIES = {
    False: {"prompt": "x", "max_tokens": 2},
    True: {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
}


class KeepAliveConnection:
    """One HTTP/1.1 connection to the server, reused for every request: a server that closes
    it after an answer fails the next request."""

    def __init__(self, server: ServerProcess) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        self.connection.connect()
        self.socket = self.connection.sock
        self.headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.connection.request(method, path, body=body, headers=self.headers)
        response = self.connection.getresponse()
        content = response.read()
        assert self.connection.sock is self.socket, "the server closed the connection"
        return response.status, content

    def check_still_usable(self) -> None:
        assert self.request("GET", "/v1/models")[0] == 200

    def close(self) -> None:
        self.connection.close()


def test_fuzzed_requests_never_answer_500_and_leave_the_server_alive(server):
    """Any JSON at all in the request fields, text UTF-8 cannot encode included: a 4xx or an
    answer, never a 500 (a crash in the server or the engine), on one keep-alive connection
    that stays usable after every error; the server still healthy afterwards."""
    connection = KeepAliveConnection(server)
    any_body = st.tuples(
        st.dictionaries(st.sampled_from(REQUEST_FIELDS), json_values(), max_size=6), st.booleans()
    )
    # One or two fields over a valid request: a bad value then meets the code past validation
    # (tokenizer, engine) as often as the validation itself.
    valid_body_with_fields = st.booleans().flatmap(
        lambda chat: st.dictionaries(
            st.sampled_from(REQUEST_FIELDS), json_values(), min_size=1, max_size=2
        ).map(lambda fields: ({**VALID_BODIES[chat], **fields}, chat))
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body_and_chat=any_body | valid_body_with_fields)
    # Found by this test: kv_transfer_params of unknown fields only was a 500.
    @example(body_and_chat=({"prompt": "x", "max_tokens": 2,
                             "kv_transfer_params": {"logits_processors": [False]}}, False))  # fmt: skip
    def check(body_and_chat):
        body, chat = body_and_chat
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and body[name] > 64:
                body[name] = 64  # keep each accepted request short
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, content = connection.request("POST", path, json.dumps(body).encode())
        assert status < 500, (body, content)
        if status >= 400:
            assert set(json.loads(content)["error"]) == {"message", "type", "param", "code"}
            connection.check_still_usable()

    try:
        check()
    finally:
        connection.close()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "Traceback" not in server.log_tail(200_000)


# Requests that carry every string field (and object key) of their endpoint.
COMMON_STRINGS = {
    "model": MODEL_NAME,
    "stop": ["s"],
    "bad_words": ["w"],
    "user": "u",
    "logit_bias": {"5": 1.0},
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "guided_json": {"type": "string"},
    "guided_regex": "a",
    "guided_choice": ["a"],
    "guided_grammar": "g",
    "guided_decoding_backend": "auto",
    "structured_outputs": {"json": "{}", "regex": "a", "choice": ["a"], "grammar": "g"},
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "n", "description": "d", "schema": {"type": "string"}},
    },
}
STRING_BODIES = {
    "/v1/completions": {**COMMON_STRINGS, "prompt": ["a", "b"], "suffix": ""},
    "/v1/chat/completions": {
        **COMMON_STRINGS,
        "messages": [
            {"role": "system", "content": "c", "name": "n"},
            {"role": "user", "content": [{"type": "text", "text": "t"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "i", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "i", "content": "r"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    },
    "/tokenize": {"model": MODEL_NAME, "prompt": "p"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1]},
}
BAD_TEXT = "ok\ud800"


def with_bad_text(value, path: str = ""):
    """(JSON path, copy of `value` with BAD_TEXT at that path) for each string and object key
    inside `value`."""
    if isinstance(value, str):
        yield path, BAD_TEXT
    elif isinstance(value, list):
        for index, item in enumerate(value):
            for item_path, bad_item in with_bad_text(item, f"{path}[{index}]"):
                yield item_path, [*value[:index], bad_item, *value[index + 1 :]]
    elif isinstance(value, dict):
        for key, item in value.items():
            item_path = f"{path}.{key}" if path else key
            key_path = f"{path}[{json.dumps(BAD_TEXT)}]"
            yield key_path, {(BAD_TEXT if k == key else k): v for k, v in value.items()}
            for bad_path, bad_item in with_bad_text(item, item_path):
                yield bad_path, {**value, key: bad_item}


def test_text_utf8_cannot_encode_is_a_400_naming_its_path_in_every_field_of_every_endpoint(
    server,
):
    """The JSON string "ok\\ud800" in any string field, nested or not, known or not, and as
    any object key: a 400 naming the JSON path; the keep-alive connection serves on."""
    fields = {
        "/v1/completions": CompletionRequest.model_fields,
        "/v1/chat/completions": ChatCompletionRequest.model_fields,
        "/tokenize": TokenizeRequest.model_fields,
        "/detokenize": DetokenizeRequest.model_fields,
    }
    connection = KeepAliveConnection(server)
    num_checked = 0
    try:
        for path, body in STRING_BODIES.items():
            cases = list(with_bad_text(body))
            cases += [(name, {**body, name: BAD_TEXT}) for name in fields[path]]
            cases.append(("an_unknown_field[0]", {**body, "an_unknown_field": [BAD_TEXT]}))
            for json_path, bad_body in cases:
                status, content = connection.request("POST", path, json.dumps(bad_body).encode())
                error = json.loads(content)["error"]
                assert (status, error["param"]) == (400, json_path), (path, bad_body, error)
                assert error["message"] == (
                    f"{json_path} is not valid Unicode text: "
                    + ("the key: " if json_path.endswith('"]') else "")
                    + "surrogates not allowed (U+D800 at position 2)"
                )
                connection.check_still_usable()
                num_checked += 1
    finally:
        connection.close()
    assert num_checked > 100
    assert "Traceback" not in server.log_tail(200_000)


def test_priority_other_than_0_is_a_400_under_fcfs_naming_the_value_and_the_policy(server):
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        response = post(server, path, {**body, "priority": 5})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "priority"
        assert "priority 5" in error["message"] and "'fcfs'" in error["message"]
        response = post(server, path, {**body, "priority": 0, "max_tokens": 1})
        assert response.status_code == 200


def test_stream_options_without_stream_is_a_400_naming_both_fields(server, client):
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        for stream in ({}, {"stream": False}):
            request = {**body, **stream, "stream_options": {"include_usage": True}}
            response = post(server, path, request)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "stream_options"
            assert "stream: true" in error["message"]
    # Streamed, or with no stream_options, the same requests are fine.
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": False})
    assert response.status_code == 200


def test_the_start_up_log_names_the_url_it_serves(server):
    url = f"http://127.0.0.1:{server.port}"
    log = server.log_tail(1_000_000)
    assert f"listening on {url}" in log
    assert log.count(f"serving on {url} (OpenAI base URL: {url}/v1)") == 1


def test_priority_orders_queued_requests_lowest_first_under_the_priority_policy(tmp_path):
    """One running slot: requests queued behind a long one run in priority order (lower value
    first, then arrival), not in the order they arrived."""
    server = ServerProcess(
        [
            "--model", "null",
            "--policy", "priority",
            "--max-num-seqs", "1",
            "--max-model-len", str(NULL_MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "8192",
            "--disable-log-stats",
        ],
        tmp_path / "log",
    )  # fmt: skip
    arrivals = [(3, "a"), (1, "b"), (4, "c"), (0, "d"), (1, "e"), (-2, "f")]

    async def run_in_turn() -> list[str]:
        finished: list[str] = []

        async def complete(http: httpx.AsyncClient, priority: int, label: str) -> None:
            # Long enough (~0.1 s each) that answers reach this client in the order they end.
            body = {"prompt": label, "max_tokens": 300, "priority": priority}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            finished.append(label)

        async def num_waiting(http: httpx.AsyncClient) -> float:
            text = (await http.get("/metrics")).text
            return float(re.search(r"^core:num_requests_waiting\{.*\} (\S+)$", text, re.M)[1])

        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            blocker = {"prompt": "long", "max_tokens": 60000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=blocker) as stream:
                lines = stream.aiter_lines()  # held: dropping it would close the connection
                await anext(lines)
                tasks = []
                for priority, label in arrivals:  # one at a time: arrival order is this order
                    tasks.append(asyncio.create_task(complete(http, priority, label)))
                    while await num_waiting(http) < len(tasks):
                        await asyncio.sleep(0.01)
            # The blocker's client left: it is aborted, and the queue runs.
            await asyncio.gather(*tasks)
        return finished

    try:
        server.wait_ready()
        finished = asyncio.run(asyncio.wait_for(run_in_turn(), 60))
    finally:
        server.stop()
    assert finished == ["f", "d", "b", "e", "a", "c"]


@pytest.mark.slow
def test_the_start_up_log_says_what_runs_where_without_gpu_words_on_a_cpu(model_server):
    log = model_server.log_tail(200_000)
    worker_line = next(line for line in log.splitlines() if "worker rank 0:" in line)
    assert ".gguf (LlamaForCausalLM) on cpu" in worker_line
    assert re.search(
        r"\d+ threads(, decode layers in one C call)?, weights [\d.]+ GiB resident, loaded in "
        r"[\d.]+ s; room for a KV cache of [\d.]+ GiB = \d+ blocks",
        worker_line,
    )
    core_line = next(line for line in log.splitlines() if "engine core ready in" in line)
    assert re.search(r"= \d+ tokens, max_model_len 512 \(up to \d+ requests", core_line)
    assert "gpu" not in log.lower()
