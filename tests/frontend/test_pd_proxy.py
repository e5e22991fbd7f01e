"""`core-pd-proxy`'s routing against mock upstreams: what the prefill and the decode instance are
asked, what the client gets back, and what happens when the prefill instance fails."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from core_engine.frontend.openai.pd_proxy import build_proxy_app

PARAMS = {"do_remote_prefill": True, "remote_request_id": "cmpl-1-0", "remote_block_ids": [1]}


class Upstreams:
    """Mock prefill (`http://p`) and decode (`http://d`) instances recording what they get."""

    def __init__(self, prefill_status: int = 200, prefill_down: bool = False) -> None:
        self.prefill_status = prefill_status
        self.prefill_down = prefill_down
        self.bodies: dict[str, list[dict]] = {"p": [], "d": []}

    def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "p" and self.prefill_down:
            raise httpx.ConnectError("connection refused", request=request)
        self.bodies[host].append(json.loads(request.content))
        if host == "p":
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "no"}})
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": PARAMS})
        if self.bodies["d"][-1].get("stream"):
            events = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
            return httpx.Response(
                200, content=events, headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    def client(self) -> TestClient:
        transport = httpx.MockTransport(self.handle)
        return TestClient(build_proxy_app("http://p", "http://d", transport=transport))


def test_a_request_goes_to_prefill_for_one_token_then_to_decode_with_its_params():
    upstreams = Upstreams()
    body = {"prompt": "hi", "max_tokens": 20, "min_tokens": 4, "temperature": 0}
    with upstreams.client() as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json() == {"choices": [{"text": "decoded"}]}
    assert upstreams.bodies["p"] == [
        {
            "prompt": "hi",
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
    ]
    assert upstreams.bodies["d"] == [{**body, "kv_transfer_params": PARAMS}]


def test_a_streamed_chat_passes_the_decode_stream_through():
    upstreams = Upstreams()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with upstreams.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    (prefill,) = upstreams.bodies["p"]
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1
    assert upstreams.bodies["d"] == [{**body, "kv_transfer_params": PARAMS}]


def test_a_prefill_instance_down_or_failing_leaves_the_decode_instance_alone():
    for upstreams in (Upstreams(prefill_down=True), Upstreams(prefill_status=503)):
        with upstreams.client() as client:
            response = client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 200
        assert upstreams.bodies["d"] == [{"prompt": "hi"}]


def test_a_request_the_prefill_instance_refuses_is_answered_with_its_error():
    upstreams = Upstreams(prefill_status=400)
    with upstreams.client() as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "n": 0})
        assert client.post("/v1/completions", content=b"[1]").status_code == 400
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "no"}}
    assert upstreams.bodies["d"] == []


def test_without_httpx_core_pd_proxy_says_which_extra_to_install():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "from frontend.openai.pd_proxy_cli import main\n"
        "main(['--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "pip install 'core-engine[pd]'" in result.stderr
