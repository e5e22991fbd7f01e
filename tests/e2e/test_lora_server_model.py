"""core-serve with real LoRA adapters on the default model (float32): a completion through an
adapter is PEFT's greedy text, the base model's is not; an adapter loaded at runtime serves at
once; a bad one is a 400 and the server serves on; unloading an adapter while one of its
streams runs lets the stream finish, and the name is gone for new requests."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.helpers.model_fixtures import hf_greedy
from tests.helpers.server_process import ServerProcess
from tools.lora_adapters import AdapterSpec, make_peft_adapter
from tools.reference_model import converted_default_model_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
NUM_TOKENS = 12
BASE = "base"
STARTUP = AdapterSpec("sql", rank=8, target_modules=("q_proj", "v_proj", "down_proj"), seed=21)
RUNTIME = AdapterSpec("chat", rank=4, target_modules=("o_proj", "gate_proj", "up_proj"), seed=22)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (folder, PEFT's greedy completion of PROMPT), and the base model's completion."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_folder = converted_default_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    folder = tmp_path_factory.mktemp("server-adapters")
    made = {}
    with torch.no_grad():
        for spec in (STARTUP, RUNTIME):
            model = make_peft_adapter(hf_folder, spec, folder / spec.name)
            tokens = hf_greedy(model, prompt_ids, NUM_TOKENS)
            made[spec.name] = (folder / spec.name, tokenizer.decode(tokens))
        base = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
        made[BASE] = (None, tokenizer.decode(hf_greedy(base, prompt_ids, NUM_TOKENS)))
    return made


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory) -> Iterator[ServerProcess]:
    args = [
        "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256",
        "--served-model-name", BASE, "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"sql={adapters['sql'][0]}",
    ]  # fmt: skip
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    process = ServerProcess(args, tmp_path_factory.mktemp("lora-server") / "log", env=env)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def complete(server: ServerProcess, model: str, max_tokens: int = NUM_TOKENS) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)


def test_a_start_up_adapter_gives_peft_s_text_and_the_base_model_its_own(server, adapters):
    response = complete(server, "sql")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "sql"
    assert response.json()["choices"][0]["text"] == adapters["sql"][1]
    base_text = complete(server, BASE).json()["choices"][0]["text"]
    assert base_text == adapters[BASE][1] != adapters["sql"][1]
    cards = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert {card["id"]: card.get("parent") for card in cards} == {BASE: None, "sql": BASE}


def test_a_runtime_adapter_serves_at_once_and_a_bad_one_is_a_400(server, adapters, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8}))
    load = f"{server.base_url}/v1/load_lora_adapter"
    response = httpx.post(load, json={"lora_name": "bad", "lora_path": str(bad)}, timeout=60)
    assert response.status_code == 400, response.text
    assert "bad" in response.json()["error"]["message"]
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"][0])}
    assert httpx.post(load, json=body, timeout=60).status_code == 200
    response = complete(server, "chat")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == adapters["chat"][1]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert "core:lora_requests_info" in metrics


def test_unloading_an_adapter_lets_its_running_stream_finish(server, adapters):
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 64, "temperature": 0.0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    texts, finish_reason = [], None
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=120
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            texts.append(choice["text"])
            finish_reason = choice.get("finish_reason") or finish_reason
            if len(texts) == 1:  # the stream runs: unload its adapter now
                unload = f"{server.base_url}/v1/unload_lora_adapter"
                assert httpx.post(unload, json={"lora_name": "sql"}, timeout=30).status_code == 200
    assert finish_reason == "length"
    assert "".join(texts).startswith(adapters["sql"][1])
    assert complete(server, "sql").status_code == 404
