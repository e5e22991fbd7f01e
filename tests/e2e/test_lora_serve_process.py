"""core-serve's LoRA flags in a real server process on the null model (whose workers report no
LoRA target modules, so no adapter fits it): refusals, the runtime-updating switch and the
metrics. Generation with real adapters is tested on a real model elsewhere."""

from __future__ import annotations

import httpx

from tests.frontend.test_lora_adapters import write_adapter
from tests.helpers.server_process import STARTUP_TIMEOUT_S, ServerProcess

NULL_LORA_ARGS = ["--model", "null", "--enable-lora", "--max-model-len", "1024"]


def test_a_bad_start_up_adapter_is_one_line_and_exit_code_2(tmp_path):
    path = write_adapter(tmp_path / "big", rank=64)
    server = ServerProcess([*NULL_LORA_ARGS, "--lora-modules", f"big={path}"], tmp_path / "log")
    try:
        exit_code = server.process.wait(STARTUP_TIMEOUT_S)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert exit_code == 2, log
    (error_line,) = [line for line in log.splitlines() if " ERROR " in line or "ERROR:" in line]
    assert "the engine cannot run with these settings: --lora-modules big=" in error_line
    assert "rank (r) 64, above max_lora_rank 16" in error_line
    assert "Traceback" not in log


def test_vllms_switch_opens_the_load_routes_and_a_bad_load_leaves_the_server_serving(tmp_path):
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    server = ServerProcess(NULL_LORA_ARGS, tmp_path / "log", env=env)
    try:
        server.wait_ready()
        url = server.base_url
        body = {"lora_name": "a", "lora_path": write_adapter(tmp_path / "a")}
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "lora_path"
        response = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert response.status_code == 404
        assert "no LoRA adapter named 'a'" in response.json()["error"]["message"]
        assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == ["null"]
        completion = httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert completion.json()["choices"][0]["text"] == "**"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'core:lora_requests_info{max_lora="1",running_lora_adapters=""' in metrics
    finally:
        server.stop()


def test_without_the_switch_the_load_routes_do_not_exist(tmp_path):
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}
    server = ServerProcess(NULL_LORA_ARGS, tmp_path / "log", env=env)
    try:
        server.wait_ready()
        body = {"lora_name": "a", "lora_path": str(tmp_path)}
        response = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body)
        assert response.status_code == 404
    finally:
        server.stop()
