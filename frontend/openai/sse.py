"""Server-sent events: each chunk a `data: <json>` event, the stream ended by `data: [DONE]`;
a stream that fails carries an error event (OpenAI's error body) before it."""

from __future__ import annotations

from pydantic import BaseModel

from core_engine.frontend.openai.api_error import APIError
from core_engine.frontend.openai.protocol.errors import ErrorResponse

SSE_DONE = "data: [DONE]\n\n"


def sse(response: BaseModel) -> str:
    return f"data: {response.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return sse(ErrorResponse(error=error.info))
