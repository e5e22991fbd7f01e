"""The server's error bodies are always well-formed OpenAI errors, whatever text they carry."""

from __future__ import annotations

import json

import pytest

from core_engine.frontend.openai.api_error import APIError, _error_json
from core_engine.frontend.openai.app import _check_model
from core_engine.frontend.openai.protocol.errors import ErrorResponse
from core_engine.frontend.openai.server_settings import ServerSettings


def test_a_404_naming_a_model_that_utf8_cannot_encode_has_a_json_body():
    with pytest.raises(APIError) as error:
        _check_model("a\ud800", ServerSettings(served_model_names=("served",)))
    response = _error_json(error.value)
    assert response.status_code == 404
    body = json.loads(response.body)
    assert body["error"]["message"] == (
        "The model `a\\ud800` does not exist; this server serves `served`"
    )
    assert body["error"]["code"] == "model_not_found"


def test_an_error_body_that_cannot_be_built_is_answered_with_a_fixed_one(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("cannot serialize")

    monkeypatch.setattr(ErrorResponse, "model_dump", fail)
    response = _error_json(APIError(400, "bad value", param="stop"))
    assert response.status_code == 400
    error = json.loads(response.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "could not be encoded" in error["message"]
