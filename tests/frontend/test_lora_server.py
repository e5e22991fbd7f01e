"""The OpenAI server's LoRA adapters, in process on a fake engine core (test_lora_adapters.py's
`FakeCoreClient`): `model` naming an adapter, /v1/models, the runtime load and unload routes and
their switch, bad adapters answered 400 while the server serves on, start-up adapters and their
log line, and the `lora_requests_info` gauge on /metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core_engine.frontend.openai.app import build_app
from core_engine.frontend.openai.lora_modules import LoRAModulePath
from core_engine.frontend.openai.server_settings import ServerSettings
from core_engine.proto import LoRARequest, SchedulerStats
from core_engine.proto.engine_config import EngineConfig
from tests.frontend.test_lora_adapters import (
    LORA_CONFIG,
    FakeCoreClient,
    use_fake_cores,
    write_adapter,
)

BASE = "base-model"
ALIAS = "base-alias"
SETTINGS = ServerSettings(served_model_names=(BASE, ALIAS), log_stats_interval_s=None)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


class Server:
    """A TestClient on the app, and the fake engine core behind it."""

    def __init__(self, client: TestClient, core: FakeCoreClient) -> None:
        self.client = client
        self.core = core

    def complete(self, model: str, **fields) -> dict:
        body = {"model": model, "prompt": "hi", "max_tokens": 3, **fields}
        response = self.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def sent_adapters(self) -> list[str | None]:
        """The adapter name of every core request so far (None: the base model)."""
        return [r.lora_request and r.lora_request.lora_name for r in self.core.requests]


@pytest.fixture()
def adapters(tmp_path) -> dict[str, str]:
    return {name: write_adapter(tmp_path / name) for name in ("sql", "chat", "spare")}


@pytest.fixture()
def serve(monkeypatch) -> Iterator:
    """`serve(settings, config=LORA_CONFIG)`: a running Server (closed after the test)."""
    cores = use_fake_cores(monkeypatch)
    clients = []

    def start(settings: ServerSettings, config: EngineConfig = LORA_CONFIG) -> Server:
        client = TestClient(build_app(config, settings))
        client.__enter__()
        clients.append(client)
        return Server(client, cores[-1])

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def with_adapters(adapters: dict[str, str], *names: str, **settings) -> ServerSettings:
    modules = tuple(LoRAModulePath(name, adapters[name]) for name in names)
    return replace(SETTINGS, lora_modules=modules, **settings)


def test_a_model_naming_an_adapter_runs_with_it_and_answers_with_its_name(serve, adapters):
    server = serve(with_adapters(adapters, "sql", "chat"))
    completion = server.complete("sql")
    assert completion["model"] == "sql" and completion["choices"][0]["text"] == "***"
    chat = server.client.post("/v1/chat/completions", json={"model": "chat", **CHAT}).json()
    assert chat["model"] == "chat" and chat["choices"][0]["message"]["content"] == "**"
    stream = server.client.post(
        "/v1/chat/completions", json={"model": "chat", "stream": True, **CHAT}
    )
    assert '"model":"chat"' in stream.text and stream.text.endswith("data: [DONE]\n\n")
    assert server.complete(ALIAS)["model"] == BASE
    assert server.sent_adapters() == ["sql", "chat", "chat", None]
    assert server.core.requests[0].lora_request == LoRARequest("sql", 1, adapters["sql"])


def test_models_lists_the_base_names_then_each_adapter_with_parent_and_root(serve, adapters):
    modules = (
        LoRAModulePath("sql", adapters["sql"]),
        LoRAModulePath("chat", adapters["chat"], base_model_name=ALIAS),
    )
    server = serve(replace(SETTINGS, lora_modules=modules))
    cards = server.client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (BASE, None, None),
        (ALIAS, None, None),
        ("sql", BASE, adapters["sql"]),
        ("chat", ALIAS, adapters["chat"]),
    ]
    card = server.client.get("/v1/models/sql").json()
    assert (card["id"], card["parent"], card["root"]) == ("sql", BASE, adapters["sql"])
    response = server.client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == (
        f"The model `nope` does not exist; this server serves `{BASE}`, `{ALIAS}` and the LoRA "
        "adapters `sql`, `chat`"
    )
    assert server.client.post("/tokenize", json={"model": "sql", "prompt": "ab"}).json()["count"]


def test_load_and_unload_answer_404_unless_runtime_updating_is_allowed(serve, adapters):
    server = serve(SETTINGS)
    for path, body in ((LOAD, {"lora_name": "a", "lora_path": adapters["sql"]}), (UNLOAD, {})):
        response = server.client.post(path, json=body)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"


def test_adapters_load_and_unload_at_runtime_and_a_reload_gets_a_new_id(serve, adapters):
    server = serve(replace(SETTINGS, allow_runtime_lora_updating=True))
    body = {"lora_name": "sql", "lora_path": adapters["sql"]}
    response = server.client.post(LOAD, json=body)
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'sql' added successfully."
    assert [card["id"] for card in server.client.get("/v1/models").json()["data"]][-1] == "sql"
    assert server.complete("sql")["model"] == "sql"

    response = server.client.post(UNLOAD, json={"lora_name": "sql"})
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'sql' removed successfully."
    response = server.client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
    assert response.status_code == 404
    assert server.client.post(LOAD, json=body).status_code == 200
    server.complete("sql")
    assert [r.lora_request.lora_int_id for r in server.core.requests] == [1, 2]


def test_bad_loads_are_400s_naming_the_problem_and_the_server_serves_on(serve, adapters, tmp_path):
    server = serve(with_adapters(adapters, "sql", allow_runtime_lora_updating=True))
    broken = write_adapter(tmp_path / "broken", config_text='{"r": ')
    too_big = write_adapter(tmp_path / "too-big", rank=32)
    refusals = [
        ({"lora_name": "b", "lora_path": broken}, "lora_path", "is not valid JSON"),
        ({"lora_name": "b", "lora_path": too_big}, "lora_path", "rank (r) 32, above max_lora_rank"),
        ({"lora_name": "b", "lora_path": str(tmp_path / "none")}, "lora_path", "does not exist"),
        ({"lora_name": "sql", "lora_path": adapters["spare"]}, "lora_name", "already loaded"),
        ({"lora_name": ALIAS, "lora_path": adapters["spare"]}, "lora_name", "base model"),
        ({"lora_name": "b", "lora_path": adapters["spare"], "load_inplace": True}, None, ""),
    ]
    for body, param, message in refusals:
        response = server.client.post(LOAD, json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and message in error["message"], error
        if param is not None:
            assert error["param"] == param, error
    response = server.client.post(UNLOAD, json={"lora_name": "nope"})
    assert response.status_code == 404
    assert "no LoRA adapter named 'nope'" in response.json()["error"]["message"]

    assert server.client.get("/health").status_code == 200
    assert server.complete("sql")["model"] == "sql"
    assert [card["id"] for card in server.client.get("/v1/models").json()["data"]] == [
        BASE,
        ALIAS,
        "sql",
    ]


def test_loading_on_an_engine_without_lora_says_to_enable_it(serve, adapters):
    server = serve(
        replace(SETTINGS, allow_runtime_lora_updating=True), config=EngineConfig(model="null")
    )
    response = server.client.post(LOAD, json={"lora_name": "a", "lora_path": adapters["sql"]})
    assert response.status_code == 400
    assert "start it with --enable-lora" in response.json()["error"]["message"]


def test_a_bad_start_up_adapter_stops_the_start_up_in_one_line(serve, adapters, tmp_path):
    too_big = write_adapter(tmp_path / "too-big", rank=32)
    settings = replace(SETTINGS, lora_modules=(LoRAModulePath("big", too_big),))
    server = serve(settings)
    failure = server.client.app.state.start_failure
    assert failure.is_config_error
    assert failure.message.startswith(f"--lora-modules big={too_big}: LoRA adapter 'big': ")
    assert "above max_lora_rank 16" in failure.message and "\n" not in failure.message
    assert server.client.app.state.engine is None


def test_the_start_up_log_lists_the_adapters_served(serve, adapters, caplog):
    with caplog.at_level(logging.INFO, logger="core_engine.frontend.openai.app"):
        serve(with_adapters(adapters, "sql", "chat"))
    assert (
        f"LoRA adapters served: sql ({adapters['sql']}), chat ({adapters['chat']})"
        in caplog.messages
    )


def test_metrics_carry_the_lora_requests_info_gauge_from_the_scheduler_stats(serve, adapters):
    server = serve(with_adapters(adapters, "sql"))
    server.core.stats = SchedulerStats(
        num_running_reqs=1, running_lora_adapters=["sql"], waiting_lora_adapters=["a", "b"]
    )
    text = server.client.get("/metrics").text
    assert (
        'core:lora_requests_info{max_lora="2",running_lora_adapters="sql",'
        'waiting_lora_adapters="a,b"}' in text
    )
    plain = serve(SETTINGS, config=EngineConfig(model="null"))
    assert "lora_requests_info" not in plain.client.get("/metrics").text


def test_an_adapter_checked_at_load_is_not_read_again_per_request(serve, adapters):
    """Its check's verdict is kept by (lora_int_id, path): files that change afterwards do not
    turn its requests into 400s (the engine keeps the weights it loaded by id)."""
    server = serve(with_adapters(adapters, "sql"))
    Path(adapters["sql"], "adapter_config.json").write_text("{broken")
    assert server.complete("sql")["model"] == "sql"
