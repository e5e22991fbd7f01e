"""core-serve end to end: a real server process, the official `openai` client and raw HTTP.

Most tests share one server on the null model (token 42, "*" in the byte tokenizer, every
step). Tests that kill or stop a server start their own; one compares the default SmolLM2
model's greedy output over HTTP with the in-process engine (core.in_process_engine).
The server's process life cycle (signals, engine death, ports, attaching) is
test_server_lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from frontend.null_tokenizer import NullTokenizer
from proto import SamplingParams
from proto.engine_config import EngineConfig
from tests.server_process import ServerProcess, wait_until

API_KEY = "test-key"
MODEL_NAME = "null-model"
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
            "--served-model-name", MODEL_NAME,
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


def test_client_disconnect_mid_stream_aborts_the_request(server):
    # 60000 null tokens take many seconds: only an abort can free the blocks in time.
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 60000, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
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
    assert (response.status_code, response.json()["error"]["param"]) == (400, "messages")
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
        "message": f"The model `no-such-model` does not exist; this server serves `{MODEL_NAME}`",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_models_health_and_metrics(server, client):
    (card,) = client.models.list().data
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
    from tests.engine_helpers import generate

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


REQUEST_FIELDS = [
    "prompt", "messages", "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "stop", "seed", "stream", "logprobs", "top_logprobs", "echo", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids", "min_tokens",
    "ignore_eos", "bad_words", "response_format", "structured_outputs", "guided_json",
    "tools", "tool_choice", "prompt_logprobs", "best_of", "suffix", "user", "stream_options",
    "include_stop_str_in_output", "skip_special_tokens", "max_completion_tokens",
]  # fmt: skip


def json_values():
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=20)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=12,
    )


def test_fuzzed_requests_never_answer_500_and_leave_the_server_alive(server):
    """Any JSON at all in the request fields: a 4xx or an answer, never a 500 (a crash in the
    server or the engine), and the server still healthy afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    fields = st.dictionaries(st.sampled_from(REQUEST_FIELDS), json_values(), max_size=6)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=fields, chat=st.booleans())
    def check(body, chat):
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
            body["max_tokens"] = 64  # keep each accepted request short
        path = "/v1/chat/completions" if chat else "/v1/completions"
        response = httpx.post(
            f"{server.base_url}{path}",
            content=json.dumps(body, allow_nan=True).encode(),
            headers=headers,
            timeout=30,
        )
        assert response.status_code < 500, (body, response.text)

    check()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "Traceback" not in server.log_tail(200_000)


@pytest.mark.slow
def test_the_start_up_log_says_what_runs_where_without_gpu_words_on_a_cpu(model_server):
    log = model_server.log_tail(200_000)
    worker_line = next(line for line in log.splitlines() if "worker rank 0:" in line)
    assert ".gguf (LlamaForCausalLM) on cpu" in worker_line
    assert re.search(
        r"threads, loaded in [\d.]+ s; room for a KV cache of [\d.]+ GiB = \d+ blocks", worker_line
    )
    core_line = next(line for line in log.splitlines() if "engine core ready in" in line)
    assert re.search(r"= \d+ tokens, max_model_len 512 \(up to \d+ requests", core_line)
    assert "gpu" not in log.lower()
