"""The prefill/decode router behind `core-pd-proxy`: an OpenAI-compatible server that sends each
completion or chat request through a prefill instance and then a decode instance.

1. To the prefill instance: the request with max_tokens 1, not streamed, and
   `kv_transfer_params: {"do_remote_decode": true}`; its answer's `kv_transfer_params` say where
   the decode instance pulls the prompt's KV from.
2. To the decode instance: the request as the client sent it, plus those `kv_transfer_params`;
   its answer (streamed or not) goes back to the client unchanged.

A prefill instance that cannot be reached or fails (5xx) costs nothing but time: the request
goes to the decode instance without params, which computes the prompt itself. A prefill answer
of 4xx (the request is bad) goes back to the client as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization",)


class PDRouter:
    """Routes requests over `client` to `prefill_url` then `decode_url` (base URLs)."""

    def __init__(self, prefill_url: str, decode_url: str, client: httpx.AsyncClient) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.client = client

    async def route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        prefill = await self._prefill(path, body, headers)
        if isinstance(prefill, Response):
            return prefill
        decode_body = dict(body)
        if prefill is not None:
            decode_body["kv_transfer_params"] = prefill
        request = self.client.build_request(
            "POST", self.decode_url + path, json=decode_body, headers=headers
        )
        try:
            reply = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"decode instance {self.decode_url} failed: {exc}"}, 503)
        return StreamingResponse(
            reply.aiter_bytes(),
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
            background=BackgroundTask(reply.aclose),
        )

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The prefill answer's kv_transfer_params (None when it has none or failed), or the
        client's error response when the prefill instance refused the request."""
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)  # would exceed max_tokens 1
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        try:
            reply = await self.client.post(
                self.prefill_url + path, json=prefill_body, headers=headers
            )
        except httpx.HTTPError as exc:
            logger.warning("prefill instance %s failed (%s): decoding alone", self.prefill_url, exc)
            return None
        if reply.status_code >= 500:
            logger.warning(
                "prefill instance %s answered %d: decoding alone",
                self.prefill_url,
                reply.status_code,
            )
            return None
        if reply.status_code != 200:
            return Response(
                reply.content,
                status_code=reply.status_code,
                media_type=reply.headers.get("content-type"),
            )
        return reply.json().get("kv_transfer_params")

    async def forward_get(self, path: str, headers: dict[str, str]) -> Response:
        """A GET answered by the decode instance (models, health)."""
        try:
            reply = await self.client.get(self.decode_url + path, headers=headers)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"decode instance unreachable: {exc}"}, 503)
        return Response(
            reply.content,
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
        )


def build_proxy_app(
    prefill_url: str,
    decode_url: str,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """`transport`: how the upstream requests travel (tests pass a mock; default: HTTP)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport)
    router = PDRouter(prefill_url, decode_url, client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="core-pd-proxy", lifespan=lifespan)
    app.state.router = router

    async def routed(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the request body is not JSON"}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the request body must be a JSON object"}, 400)
        return await router.route(request.url.path, body, _forwarded(request))

    async def forwarded_get(request: Request) -> Response:
        return await router.forward_get(request.url.path, _forwarded(request))

    for path in ROUTED_PATHS:
        app.add_api_route(path, routed, methods=["POST"])
    for path in ("/v1/models", "/health", "/version"):
        app.add_api_route(path, forwarded_get, methods=["GET"])
    return app


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
