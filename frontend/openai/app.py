"""OpenAI-compatible HTTP server: FastAPI routes on one `AsyncEngineClient`.

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events ending in
`data: [DONE]` with `stream: true`), GET /v1/models and /v1/models/{id}, vLLM's POST /tokenize
and /detokenize, GET /version, /health and /metrics (Prometheus text), GET /engine/state (JSON
for the web page at /, `frontend.openai.web_ui`). Every error uses OpenAI's
body, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid parameters (a body that
is not JSON included, and text UTF-8 cannot encode anywhere in a body, named by its JSON path
such as `stop[0]`), 401 for a bad API key, 404 for an unknown model or route, 405 for a wrong
method, 413 for a body over `--max-request-body-bytes`, 500 for a bug or a request the engine
failed, 503 once the engine is dead or the server is shutting down. A stream that
fails the same way ends with such an error event before `data: [DONE]`.
A streaming client that disconnects has its requests aborted, which frees their KV blocks.
`priority` (both endpoints) orders requests under `--policy priority` (lower first); any value
but 0 is a 400 under fcfs.
LoRA adapters (`--enable-lora`): a request whose `model` names a loaded adapter runs with it and
its response carries the adapter's name; /v1/models lists every adapter after the base model
(`parent` the base model's name, `root` the adapter's path). Adapters come from `--lora-modules`
(checked once the engine is ready: a bad one stops the start-up, as a bad setting does) and,
when runtime updating is allowed, from vLLM's load and unload routes (`frontend.openai.lora_routes`).
How the app is run (port, signals, engine death) is `frontend.openai.http_server`'s; the
completions and chat handlers are `frontend.openai.completions` and `frontend.openai.chat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from core_engine.common.config_error import ConfigError
from core_engine.frontend.async_engine_client import AsyncEngineClient, InvalidPromptError
from core_engine.frontend.core_client import EngineCoreNotFoundError, EngineDeadError
from core_engine.frontend.data_parallel_client import sum_stats
from core_engine.frontend.lora_adapter_registry import LoRAAdapterRegistry
from core_engine.frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from core_engine.frontend.openai.api_error import APIError, add_error_handlers
from core_engine.frontend.openai.body_limit import BodySizeLimit
from core_engine.frontend.openai.chat import create_chat_completion
from core_engine.frontend.openai.completions import create_completion
from core_engine.frontend.openai.lora_modules import LoRAModulePath
from core_engine.frontend.openai.lora_routes import add_lora_adapter_routes
from core_engine.frontend.openai.protocol.chat import ChatCompletionRequest
from core_engine.frontend.openai.protocol.completions import CompletionRequest
from core_engine.frontend.openai.protocol.models import ModelCard, ModelList, VersionResponse
from core_engine.frontend.openai.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from core_engine.frontend.openai.served_models import ServedModel, ServedModels
from core_engine.frontend.openai.server_settings import ServerSettings
from core_engine.frontend.openai.web_ui import add_web_ui_routes
from core_engine.proto import SchedulerStats
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def build_app(
    engine_config: EngineConfig, settings: ServerSettings, address: str | None = None
) -> FastAPI:
    """The app; its lifespan starts the engine (or connects to `address`) and shuts it down.

    `app.state.engine` is the `AsyncEngineClient` once it is ready, with the `--lora-modules`
    adapters loaded (`app.state.lora_adapters`). Setting the event
    `app.state.stop_requested` during start-up abandons it (the core is stopped, and
    `app.state.engine` stays None) instead of waiting for the model to load. When the engine
    cannot start (a setting it cannot run with, a bad `--lora-modules` adapter, no core
    connecting to `address`, a core that died starting), `app.state.start_failure` says why
    and the engine stays None.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = AsyncEngineClient(engine_config, address, model_name=settings.served_model_name)
        lora_adapters = LoRAAdapterRegistry(engine.check_lora_request, settings.served_model_names)
        app.state.lora_adapters = lora_adapters
        try:
            started = await _start_unless_stopped(engine, app.state.stop_requested)
            if started:
                await _load_lora_modules(lora_adapters, settings.lora_modules)
        except ConfigError as exc:  # the message names the setting: no traceback
            await engine.shutdown()
            app.state.start_failure = StartFailure(str(exc), is_config_error=True)
            started = False
        except (EngineCoreNotFoundError, EngineDeadError) as exc:  # the core's log has the rest
            await engine.shutdown()
            app.state.start_failure = StartFailure(str(exc), is_config_error=False)
            started = False
        except BaseException:
            await engine.shutdown()
            raise
        stats_task = None
        if started:
            app.state.engine = engine
            logger.info(
                "serving %s (max_model_len=%d)", settings.served_model_name, engine.max_model_len
            )
            _log_lora_adapters(engine, lora_adapters, settings)
            if settings.log_stats_interval_s is not None:
                stats_task = asyncio.create_task(_log_stats(engine, settings.log_stats_interval_s))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await engine.shutdown()

    app = FastAPI(title="core-engine OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_request_body_bytes)
    app.state.settings = settings
    app.state.engine = None
    app.state.lora_adapters = None  # a LoRAAdapterRegistry once the lifespan starts
    app.state.start_failure = None  # a StartFailure when the engine never started
    app.state.stop_requested = asyncio.Event()
    add_error_handlers(app)
    _add_info_routes(app, settings)
    _add_token_routes(app, settings)
    _add_generation_routes(app, settings)
    if settings.allow_runtime_lora_updating:
        add_lora_adapter_routes(app, _api_key_checker(settings.api_key))
    add_web_ui_routes(app, settings, _api_key_checker(settings.api_key))
    return app


@dataclass(frozen=True, slots=True)
class StartFailure:
    """Why the engine never started, in one line: a setting it cannot run with
    (`is_config_error`, the message names it), no core at the attach address, or a core that
    died starting (its own log has the traceback)."""

    message: str
    is_config_error: bool


async def _start_unless_stopped(engine: AsyncEngineClient, stop_requested: asyncio.Event) -> bool:
    """Starts the engine; False (start-up cancelled, the core stopped) if `stop_requested` is
    set first. Start-up failures raise."""
    start = await _run_until(engine.start(), stop_requested.wait())
    if start.cancelled():
        return False
    start.result()
    return True


async def _run_until(work: Awaitable[T], trigger: Awaitable[object]) -> asyncio.Future[T]:
    """Runs `work` until it ends or `trigger` does; in the second case cancels `work` and waits
    for its cancellation to run (a cancelled task is done only then). Returns `work`'s future,
    done: with its result or exception, or cancelled."""
    work_future = asyncio.ensure_future(work)
    trigger_future = asyncio.ensure_future(trigger)
    try:
        await asyncio.wait({work_future, trigger_future}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        trigger_future.cancel()
        if not work_future.done():
            work_future.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_future
    return work_future


async def _load_lora_modules(
    lora_adapters: LoRAAdapterRegistry, lora_modules: tuple[LoRAModulePath, ...]
) -> None:
    """Loads the `--lora-modules` adapters, their files read on a thread; ConfigError naming
    the flag's value and what is wrong with it for the first bad one."""
    for module in lora_modules:
        try:
            await asyncio.to_thread(
                lora_adapters.load, module.name, module.path, module.base_model_name
            )
        except ValueError as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from exc


def _log_lora_adapters(
    engine: AsyncEngineClient, lora_adapters: LoRAAdapterRegistry, settings: ServerSettings
) -> None:
    """One line naming the adapters served, once the engine is ready (none: no line, unless
    adapters may still be loaded)."""
    if lora_adapters:
        described = ", ".join(f"{a.name} ({a.path})" for a in lora_adapters.adapters)
        logger.info("LoRA adapters served: %s", described)
    elif engine.supports_lora and settings.allow_runtime_lora_updating:
        logger.info("serving no LoRA adapters yet (load them with POST /v1/load_lora_adapter)")


async def _log_stats(engine: AsyncEngineClient, interval_s: float) -> None:
    """Logs throughput, queues, KV usage and prefix hit rate every `interval_s`."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats = await engine.get_stats()
        except EngineDeadError:  # the core client has logged why
            return
        logger.info(engine.metrics.log_line(stats, time.monotonic()))


def _add_info_routes(app: FastAPI, settings: ServerSettings) -> None:
    """/health, /metrics, /v1/models, /v1/models/{id} and /version."""
    check_api_key = _api_key_checker(settings.api_key)

    @app.get("/health")
    async def health(request: Request) -> Response:
        await _engine(request).check_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text. Once the engine is dead its scheduler reads as empty, and the
        frontend's counters (requests by how they ended: what failed, and how many) stay."""
        engine = _engine(request)
        try:
            per_core = await engine.get_stats_per_core()
        except EngineDeadError:
            per_core = [SchedulerStats()]
        stats = sum_stats(per_core)
        text = engine.metrics.render_prometheus(stats, per_core)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models(request: Request) -> ModelList:
        max_model_len = _engine(request).max_model_len
        served_models = ServedModels(settings.served_model_names, _lora_adapters(request))
        return ModelList(data=served_models.cards(max_model_len))

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)])
    async def model(model_id: str, request: Request) -> ModelCard:
        served_models = ServedModels(settings.served_model_names, _lora_adapters(request))
        return served_models.card(model_id, _engine(request).max_model_len)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())


def _add_token_routes(app: FastAPI, settings: ServerSettings) -> None:
    """vLLM's /tokenize and /detokenize."""
    check_api_key = _api_key_checker(settings.api_key)

    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        # An adapter tokenizes as its base model does.
        _check_model(body.model, settings, _lora_adapters(request))
        engine = _engine(request)
        try:
            if body.messages is not None:
                conversation = [m.for_template() for m in body.messages]
                tokens = await asyncio.to_thread(
                    engine.apply_chat_template, conversation, body.add_generation_prompt
                )
            else:
                tokens = await asyncio.to_thread(
                    engine.tokenize, body.prompt, body.add_special_tokens
                )
        except InvalidPromptError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens
        )

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        _check_model(body.model, settings, _lora_adapters(request))
        engine = _engine(request)
        outside = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if outside:
            message = f"token id {outside[0]} is outside the vocabulary [0, {engine.vocab_size})"
            raise APIError(400, message, param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, list(body.tokens))
        return DetokenizeResponse(prompt=text)


def _add_generation_routes(app: FastAPI, settings: ServerSettings) -> None:
    """/v1/completions and /v1/chat/completions, each cancelled if its client leaves."""
    check_api_key = _api_key_checker(settings.api_key)

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)], response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | BaseModel:
        served = _check_model(body.model, settings, _lora_adapters(request))
        engine = _engine(request)
        return await _until_disconnected(request, create_completion(engine, body, served))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)], response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> Response | BaseModel:
        served = _check_model(body.model, settings, _lora_adapters(request))
        engine = _engine(request)
        return await _until_disconnected(
            request, create_chat_completion(engine, body, settings, served)
        )


async def _until_disconnected(
    request: Request, handler: Coroutine[Any, Any, Response | BaseModel]
) -> Response | BaseModel:
    """Runs `handler`, cancelling it (which aborts its engine requests) if the client leaves.

    Streaming responses return at once; their disconnects cancel the event stream instead.
    """
    work = await _run_until(handler, _wait_for_disconnect(request))
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _api_key_checker(api_key: str | None) -> Any:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(
                401,
                "Incorrect or missing API key (send `Authorization: Bearer <key>`)",
                code="invalid_api_key",
            )

    return check_api_key


def _engine(request: Request) -> AsyncEngineClient:
    return request.app.state.engine


def _lora_adapters(request: Request) -> LoRAAdapterRegistry:
    return request.app.state.lora_adapters


def _check_model(
    model: str | None, settings: ServerSettings, lora_adapters: LoRAAdapterRegistry | None = None
) -> ServedModel:
    """What `model` names: the base model or one of `lora_adapters`; a 404 naming everything
    served otherwise."""
    return ServedModels(settings.served_model_names, lora_adapters).resolve(model)


def package_version() -> str:
    """The installed core-engine distribution's version ("unknown" when run from a bare tree)."""
    try:
        return distribution_version("core-engine")
    except PackageNotFoundError:
        return "unknown"
