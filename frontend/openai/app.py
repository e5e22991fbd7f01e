"""OpenAI-compatible HTTP server: FastAPI routes on one `AsyncEngineClient`.

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events ending in
`data: [DONE]` with `stream: true`), GET /v1/models and /v1/models/{id}, vLLM's POST /tokenize
and /detokenize, GET /version, /health and /metrics (Prometheus text). Every error uses OpenAI's
body, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid parameters (a body that
is not JSON included, and text UTF-8 cannot encode anywhere in a body, named by its JSON path
such as `stop[0]`), 401 for a bad API key, 404 for an unknown model or route, 405 for a wrong
method, 413 for a body over `--max-request-body-bytes`, 500 for a bug or a request the engine
failed (a worker died), 503 once the engine is dead or the server is shutting down. A stream that
fails the same way ends with such an error event before `data: [DONE]`.
A streaming client that disconnects has its requests aborted, which frees their KV blocks.
`priority` (both endpoints) orders requests under `--policy priority` (lower first); any value
but 0 is a 400 under fcfs.
How the app is run (port, signals, engine death) is `frontend.openai.http_server`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any, TypeVar

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    Prompt,
    ServiceStoppedError,
)
from frontend.core_client import EngineCoreNotFoundError, EngineDeadError
from frontend.data_parallel_client import sum_stats
from frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from frontend.openai.body_limit import BodySizeLimit
from frontend.openai.logprobs import (
    append_logprobs,
    chat_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from frontend.openai.protocol.sampling_fields import (
    TEXT_NOT_UTF8,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    VersionResponse,
    random_id,
)
from frontend.openai.tool_calls import ToolChoiceError, ToolPlan, plan_tools
from frontend.request_output import CompletionOutput, RequestOutput
from proto import SamplingParams, SchedulerStats
from proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# Larger bodies get a 413 before they are read: a whole-context prompt as JSON token ids fits
# many times over.
DEFAULT_MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_LEADING_FIELD = re.compile(r"^([a-z_]+): ")
HTTP_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}
UNENCODABLE_ERROR_BODY = {
    "error": {
        "message": "the error's message could not be encoded (the server's log has it)",
        "type": "internal_error",
        "param": None,
        "code": None,
    }
}


@dataclass(slots=True, frozen=True)
class ServerSettings:
    """How the server presents the engine. `log_stats_interval_s` None disables the stats log."""

    served_model_name: str
    api_key: str | None = None
    log_stats_interval_s: float | None = 10.0
    tool_call_parser: str | None = None  # reads tool calls back for tool_choice "auto"
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


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


def build_app(
    engine_config: EngineConfig, settings: ServerSettings, address: str | None = None
) -> FastAPI:
    """The app; its lifespan starts the engine (or connects to `address`) and shuts it down.

    `app.state.engine` is the `AsyncEngineClient` once it is ready. Setting the event
    `app.state.stop_requested` during start-up abandons it (the core is stopped, and
    `app.state.engine` stays None) instead of waiting for the model to load. When no core
    connects to `address`, `app.state.start_failure` says so and the engine stays None.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = AsyncEngineClient(engine_config, address, model_name=settings.served_model_name)
        try:
            started = await _start_unless_stopped(engine, app.state.stop_requested)
        except EngineCoreNotFoundError as exc:  # its message says what to do: no traceback
            await engine.shutdown()
            app.state.start_failure = str(exc)
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
    app.state.start_failure = None  # why an attached engine never started (see lifespan)
    app.state.stop_requested = asyncio.Event()
    _add_error_handlers(app)
    _add_routes(app, settings)
    return app


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


async def _log_stats(engine: AsyncEngineClient, interval_s: float) -> None:
    """Logs throughput, queues, KV usage and prefix hit rate every `interval_s`."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats = await engine.get_stats()
        except EngineDeadError:  # the core client has logged why
            return
        logger.info(engine.metrics.log_line(stats, time.monotonic()))


def _add_error_handlers(app: FastAPI) -> None:
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
        return _error_json(_validation_error(exc.errors()))

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


def _add_routes(app: FastAPI, settings: ServerSettings) -> None:
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
        card = ModelCard(
            id=settings.served_model_name, max_model_len=_engine(request).max_model_len
        )
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)])
    async def model(model_id: str, request: Request) -> ModelCard:
        _check_model(model_id, settings)
        return ModelCard(id=model_id, max_model_len=_engine(request).max_model_len)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        _check_model(body.model, settings)
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
        _check_model(body.model, settings)
        engine = _engine(request)
        try:
            token_ids = engine.tokenize(body.tokens)  # checks them against the vocabulary
        except InvalidPromptError as exc:
            raise APIError(400, str(exc), param="tokens") from exc
        text = await asyncio.to_thread(engine.tokenizer.decode, token_ids)
        return DetokenizeResponse(prompt=text)

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)], response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | BaseModel:
        _check_model(body.model, settings)
        engine = _engine(request)
        return await _until_disconnected(
            request, _create_completion(engine, body, settings.served_model_name)
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)], response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> Response | BaseModel:
        _check_model(body.model, settings)
        engine = _engine(request)
        return await _until_disconnected(request, _create_chat_completion(engine, body, settings))


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


async def _create_completion(
    engine: AsyncEngineClient, body: CompletionRequest, model_name: str
) -> Response | BaseModel:
    params = _sampling_params(body)
    await _check_output_constraint(engine, params, body.structured_outputs_field()[1])
    request_id = random_id("cmpl")
    prompts = body.prompts()
    token_ids = [await _tokenize(engine, prompt) for prompt in prompts]
    streams = [
        _submit(engine, body, prompt, params, f"{request_id}-{index}", "prompt", ids)
        for index, (prompt, ids) in enumerate(zip(prompts, token_ids, strict=True))
    ]
    if body.stream:
        events = _completion_events(engine, body, streams, request_id, model_name)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await _final_outputs(streams)
    choices = []
    for prompt_index, final in enumerate(finals):
        echo = _prompt_text(engine, final) if body.echo else ""
        for completion in final.outputs:
            if body.scores_prompt_only:  # the one token sampled is not part of the answer
                completion = dataclasses.replace(completion, text="", token_ids=[], logprobs=[])
            logprobs = None
            if body.logprobs is not None:
                logprobs = echo_logprobs(engine, final) if body.echo else CompletionLogprobs()
                append_logprobs(engine, logprobs, completion, len(echo))
            choices.append(
                CompletionChoice(
                    index=prompt_index * body.n + completion.index,
                    text=echo + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=(
                        vllm_prompt_logprobs(engine, final)
                        if body.prompt_logprobs is not None
                        else None
                    ),
                )
            )
    usage = _usage(finals)
    if body.scores_prompt_only:
        usage = UsageInfo.of(usage.prompt_tokens, 0)
    return CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)


async def _completion_events(
    engine: AsyncEngineClient,
    body: CompletionRequest,
    streams: list[AsyncIterator[RequestOutput]],
    request_id: str,
    model_name: str,
) -> AsyncIterator[str]:
    """SSE chunks, one per request update; usage last if asked; then [DONE]."""
    finals: dict[int, RequestOutput] = {}
    choice_to_offset: dict[int, int] = {}  # text offset of the next token, for logprobs
    try:
        async for prompt_index, output in _merge(streams):
            choices = []
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                text = completion.text
                first = index not in choice_to_offset
                if body.echo and first:
                    text = _prompt_text(engine, output) + text
                offset = choice_to_offset.get(index, len(text) - len(completion.text))
                logprobs = None
                if body.logprobs is not None:
                    echoed = body.echo and first
                    logprobs = echo_logprobs(engine, output) if echoed else CompletionLogprobs()
                    append_logprobs(engine, logprobs, completion, offset)
                choice_to_offset[index] = offset + len(completion.text)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
            if output.finished:
                finals[prompt_index] = output
            yield _sse(CompletionResponse(id=request_id, model=model_name, choices=choices))
            if (error := _request_failed_error(output)) is not None:
                yield _sse_error(error)
        if body.include_usage_in_stream:
            usage = _usage(list(finals.values()))
            yield _sse(CompletionResponse(id=request_id, model=model_name, choices=[], usage=usage))
    except (EngineDeadError, ServiceStoppedError) as exc:
        yield _sse_error(unavailable_error(exc))
    yield SSE_DONE


async def _create_chat_completion(
    engine: AsyncEngineClient, body: ChatCompletionRequest, settings: ServerSettings
) -> Response | BaseModel:
    plan = _tool_plan(engine, body, settings)
    params = _sampling_params(body)
    _, constraint_field = body.structured_outputs_field()
    if (tool_constraint := plan.constraint()) is not None:
        if params.structured_outputs is not None:
            raise APIError(
                400,
                f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined "
                f"with {constraint_field}",
                param="tool_choice",
            )
        params = msgspec.structs.replace(params, structured_outputs=tool_constraint)
        constraint_field = "tools"
    await _check_output_constraint(engine, params, constraint_field)
    try:
        prompt_token_ids = await asyncio.to_thread(
            engine.apply_chat_template,
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            **plan.template_kwargs(),
        )
    except InvalidPromptError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the user's
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    request_id = random_id("chatcmpl")
    model_name = settings.served_model_name
    stream = _submit(engine, body, prompt_token_ids, params, request_id, "messages")
    if body.stream:
        events = _chat_events(engine, body, plan, stream, request_id, model_name)
        return StreamingResponse(events, media_type="text/event-stream")
    (final,) = await _final_outputs([stream])
    choices = []
    for completion in final.outputs:
        content, tool_calls = plan.extract(completion.text)
        choices.append(
            ChatCompletionChoice(
                index=completion.index,
                message=AssistantMessage(content=content, tool_calls=tool_calls),
                logprobs=chat_logprobs(engine, completion) if body.logprobs else None,
                finish_reason=_chat_finish_reason(plan, completion.finish_reason, tool_calls),
                stop_reason=completion.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model_name,
        choices=choices,
        usage=_usage([final]),
        prompt_logprobs=(
            vllm_prompt_logprobs(engine, final) if body.prompt_logprobs is not None else None
        ),
    )


def _tool_plan(
    engine: AsyncEngineClient, body: ChatCompletionRequest, settings: ServerSettings
) -> ToolPlan:
    template = engine.tokenizer.chat_template or ""
    try:
        return plan_tools(body, settings.tool_call_parser, "tools" in template)
    except ToolChoiceError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def _chat_finish_reason(plan: ToolPlan, finish_reason: str | None, tool_calls: list) -> str | None:
    """ "tool_calls" when the model chose to call (required, auto); a forced named call
    finishes as the text did ("stop"), as OpenAI answers."""
    if tool_calls and plan.mode in ("required", "auto") and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


async def _chat_events(
    engine: AsyncEngineClient,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    stream: AsyncIterator[RequestOutput],
    request_id: str,
    model_name: str,
) -> AsyncIterator[str]:
    """SSE chunks: the assistant role for every choice, then content deltas; usage; [DONE].

    A named tool call streams its arguments as they come; "required" and "auto" replies are
    read whole (a call is only known once it is complete) and sent as one delta at the end."""

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        response = ChatCompletionStreamResponse(
            id=request_id, model=model_name, choices=choices, usage=usage
        )
        return _sse(response)

    final = None
    texts = [""] * body.n  # replies read whole ("required", "auto")
    try:
        first = [DeltaMessage(role="assistant", content="") for _ in range(body.n)]
        if plan.mode == "named":
            for delta in first:
                delta.content = None
                delta.tool_calls = [
                    DeltaToolCall(
                        index=0,
                        id=random_id("call"),
                        type="function",
                        function=DeltaFunctionCall(name=plan.named, arguments=""),
                    )
                ]
        yield chunk([ChatCompletionStreamChoice(index=i, delta=d) for i, d in enumerate(first)])
        async for _, output in _merge([stream]):
            choices = []
            for completion in output.outputs:
                delta, finish_reason = _chat_delta(plan, completion, texts)
                if delta is None and finish_reason is None:
                    continue
                choices.append(
                    ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=delta or DeltaMessage(),
                        logprobs=(
                            chat_logprobs(engine, completion)
                            if body.logprobs and plan.mode in ("none", "named")
                            else None
                        ),
                        finish_reason=finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
            final = output
            if choices:
                yield chunk(choices)
            if (error := _request_failed_error(output)) is not None:
                yield _sse_error(error)
        if body.include_usage_in_stream and final is not None:
            yield chunk([], _usage([final]))
    except (EngineDeadError, ServiceStoppedError) as exc:
        yield _sse_error(unavailable_error(exc))
    yield SSE_DONE


def _chat_delta(
    plan: ToolPlan, completion: CompletionOutput, texts: list[str]
) -> tuple[DeltaMessage | None, str | None]:
    """The delta of one choice's update and its finish reason, for each tool mode."""
    if plan.mode == "none":
        return DeltaMessage(content=completion.text), completion.finish_reason
    if plan.mode == "named":
        arguments = DeltaFunctionCall(arguments=completion.text)
        delta = DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=arguments)])
        return delta, completion.finish_reason
    texts[completion.index] += completion.text
    if completion.finish_reason is None:
        return None, None
    content, tool_calls = plan.extract(texts[completion.index])
    delta = DeltaMessage(
        content=content,
        tool_calls=[
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(tool_calls)
        ]
        or None,
    )
    return delta, _chat_finish_reason(plan, completion.finish_reason, tool_calls)


async def _tokenize(engine: AsyncEngineClient, prompt: Prompt) -> list[int]:
    """A completion prompt's tokens, computed off the event loop; 400 for a bad prompt."""
    try:
        return await engine.tokenize_in_thread(prompt)
    except InvalidPromptError as exc:
        raise APIError(400, str(exc), param="prompt") from exc


def _submit(
    engine: AsyncEngineClient,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: Prompt,
    params: SamplingParams,
    request_id: str,
    prompt_param: str,
    prompt_token_ids: list[int] | None = None,
) -> AsyncIterator[RequestOutput]:
    """Validates and registers one request of `body` (streamed or not, at its priority); maps
    its refusals to 400 and a dead engine to 503."""
    try:
        return engine.generate(
            prompt,
            params,
            request_id,
            stream=body.stream,
            priority=body.priority,
            prompt_token_ids=prompt_token_ids,
        )
    except (EngineDeadError, ServiceStoppedError) as exc:
        raise unavailable_error(exc) from exc
    except InvalidPromptError as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise APIError(400, str(exc), param=param) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


async def _merge(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as (stream index, output), as outputs arrive.

    Closing (or cancelling) the merged iterator cancels every stream, which aborts their
    unfinished requests in the engine.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each non-streamed request, in order; 500 if the engine failed one."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in _merge(streams):
        finals[index] = output
    for final in finals:
        assert final is not None and final.finished
        if (error := _request_failed_error(final)) is not None:
            raise error
    return finals  # type: ignore[return-value]


def _sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return body.to_sampling_params()
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_named_in(str(exc), body)) from exc


async def _check_output_constraint(
    engine: AsyncEngineClient, params: SamplingParams, field: str | None
) -> None:
    """400 naming the field (`response_format`, `structured_outputs`, `guided_*`, `tools`)
    whose constraint this engine cannot apply; checked on a thread (the first check imports
    xgrammar, which takes seconds)."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.check_structured_outputs, params.structured_outputs)
    except InvalidPromptError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from exc


def _param_named_in(message: str, body: BaseModel) -> str | None:
    """The request field a `SamplingParams` error starts with ("min_tokens (5) must ...")."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in type(body).model_fields else None


def _check_model(model: str | None, settings: ServerSettings) -> None:
    if model is not None and model != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"`{settings.served_model_name}`",
            param="model",
            code="model_not_found",
        )


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


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    return UsageInfo.of(
        prompt_tokens=sum(final.num_prompt_tokens for final in finals),
        completion_tokens=sum(final.num_generated_tokens for final in finals),
    )


def _prompt_text(engine: AsyncEngineClient, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return engine.tokenizer.decode(output.prompt_token_ids)


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
    if param is None and (named := _LEADING_FIELD.match(message)):
        param = named.group(1)  # a check across fields names the one it blames first
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


def _sse(response: BaseModel) -> str:
    return f"data: {response.model_dump_json()}\n\n"


def _sse_error(error: APIError) -> str:
    return _sse(ErrorResponse(error=error.info))


def _request_failed_error(output: RequestOutput) -> APIError | None:
    """The error of a finished request the engine failed (a worker died, ...), else None."""
    if not output.finished or output.error is None:
        return None
    return APIError(500, output.error, "internal_error", code="request_failed")


def package_version() -> str:
    """The installed core-engine distribution's version ("unknown" when run from a bare tree)."""
    try:
        return distribution_version("core-engine")
    except PackageNotFoundError:
        return "unknown"
