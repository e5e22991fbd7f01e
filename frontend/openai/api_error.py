"""`APIError`: an error answered in OpenAI's body, `{"error": {"message", "type", "param",
"code"}}`, and the mapping of every failure a request can meet onto one: invalid parameters
(400, naming the field), an unknown route or method, an engine that is dead or a server that is
shutting down (503), a request the engine failed (500), a bug (500, logged with its traceback).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core_engine.frontend.async_engine_client import ServiceStoppedError
from core_engine.frontend.core_client import EngineDeadError
from core_engine.frontend.openai.protocol.base import PARAMETER_ERROR, TEXT_NOT_UTF8
from core_engine.frontend.openai.protocol.errors import ErrorInfo, ErrorResponse
from core_engine.frontend.request_output import RequestOutput

logger = logging.getLogger(__name__)

HTTP_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}
# Pydantic's error types for a body that is no object at all: missing (FastAPI's error for an
# empty body) or another JSON value.
NOT_AN_OBJECT_ERROR_TYPES = frozenset({"missing", "model_type", "model_attributes_type"})
# What a request body that is JSON but not an object is, by the type it decodes to.
JSON_KINDS = {
    "list": "an array",
    "str": "a string",
    "int": "a number",
    "float": "a number",
    "bool": "a boolean",
    "NoneType": "null",
}
UNENCODABLE_ERROR_BODY = {
    "error": {
        "message": "the error's message could not be encoded (the server's log has it)",
        "type": "internal_error",
        "param": None,
        "code": None,
    }
}


class APIError(Exception):
    """An error answered with OpenAI's error body and `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)


EngineUnavailable = EngineDeadError | ServiceStoppedError


def unavailable_error(exc: EngineUnavailable) -> APIError:
    """503: the engine is dead, or the server has stopped serving (shutting down)."""
    if isinstance(exc, ServiceStoppedError):
        return APIError(503, str(exc), "service_unavailable", code="shutting_down")
    return APIError(503, f"the engine is dead: {exc}", "service_unavailable", code="engine_dead")


def request_failed_error(output: RequestOutput) -> APIError | None:
    """The error of a finished request the engine failed (a worker died, ...), else None."""
    if not output.finished or output.error is None:
        return None
    return APIError(500, output.error, "internal_error", code="request_failed")


def add_error_handlers(app: FastAPI) -> None:
    """Answers every exception a route raises in OpenAI's error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_json(exc)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(ServiceStoppedError)
    async def engine_unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return _error_json(unavailable_error(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if content_type and "json" not in content_type:  # FastAPI then never parsed the body
            message = (
                "the request body must be JSON (Content-Type: application/json), got "
                f"Content-Type {content_type!r}"
            )
            return _error_json(APIError(400, message))
        errors = exc.errors()
        if (body_error := _body_error(errors[0], await request.body())) is not None:
            return _error_json(body_error)
        return _error_json(_validation_error(errors))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404 (no such route), 405 (wrong method), 413 ... in OpenAI's error body."""
        type_ = HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return _error_json(APIError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        """A bug: answered in OpenAI's error body (and logged with its traceback)."""
        logger.exception("internal error while serving a request")
        return _error_json(APIError(500, f"internal server error: {exc}", "internal_error"))


def _body_error(first: dict[str, Any], body: bytes) -> APIError | None:
    """400 for a body that is not a JSON object at all: not JSON (with the position, as line and
    column), empty, or another JSON value; None when the error is a field's."""
    location = first.get("loc", ())
    if first.get("type") == "json_invalid":
        position = next((part for part in location if isinstance(part, int)), 0)
        line = body.count(b"\n", 0, position) + 1
        column = position - (body.rfind(b"\n", 0, position) + 1) + 1
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return APIError(
            400,
            f"the request body is not valid JSON: {reason} at line {line} column {column} "
            f"(char {position})",
        )
    if tuple(location) != ("body",) or first.get("type") not in NOT_AN_OBJECT_ERROR_TYPES:
        return None
    if not body.strip():
        return APIError(400, "the request body is empty; send a JSON object")
    kind = JSON_KINDS.get(type(first.get("input")).__name__, "another JSON value")
    return APIError(400, f"the request body must be a JSON object, got {kind}")


def _validation_error(errors: Sequence[Any]) -> APIError:
    """400 naming the first invalid field, e.g. `max_tokens: Input should be >= 1`."""
    first = errors[0]
    if first.get("type") == TEXT_NOT_UTF8:  # found before any field was read: named by path
        return APIError(400, first["msg"], param=first["ctx"]["path"])
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    names = [part for part in first.get("loc", ()) if isinstance(part, str) and part != "body"]
    param = names[0] if names else None
    where = ".".join(location)
    if isinstance(first.get("input"), float) and math.isnan(first["input"]):
        message = "NaN is not a number this field accepts"
    else:
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == PARAMETER_ERROR:  # a check across fields names the one it blames
        param = first["ctx"]["param"]
    return APIError(400, f"{where}: {message}" if where else message, param=param)


def _error_json(exc: APIError) -> JSONResponse:
    """OpenAI's error body for `exc`; should building it fail, a fixed body of the same status,
    so that an error is always answered as one (never as a crash of the handler)."""
    try:
        body = ErrorResponse(error=exc.info).model_dump()
        return JSONResponse(body, status_code=exc.status_code)
    except Exception:
        logger.exception("cannot build the body of a %d error", exc.status_code)
        return JSONResponse(UNENCODABLE_ERROR_BODY, status_code=exc.status_code)
