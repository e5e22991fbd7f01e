"""POST /v1/chat/completions: the conversation rendered by the chat template, with its tools;
answered whole or as server-sent events.

Tools are planned first (`ToolPlan`): `none` streams text deltas, a named call streams its
arguments as they come, and "required" and "auto" replies are read whole (a call is only known
once it is complete) and sent as one delta at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from core_engine.frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    ServiceStoppedError,
)
from core_engine.frontend.core_client import EngineDeadError
from core_engine.frontend.openai.api_error import APIError, request_failed_error, unavailable_error
from core_engine.frontend.openai.engine_requests import (
    check_output_constraint,
    sampling_params,
    submit,
    usage,
)
from core_engine.frontend.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from core_engine.frontend.openai.output_streams import final_outputs, merge_outputs
from core_engine.frontend.openai.protocol.base import ResponseHeader, UsageInfo, random_id
from core_engine.frontend.openai.protocol.chat import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from core_engine.frontend.openai.protocol.tools import DeltaFunctionCall, DeltaToolCall
from core_engine.frontend.openai.served_models import ServedModel
from core_engine.frontend.openai.server_settings import ServerSettings
from core_engine.frontend.openai.sse import SSE_DONE, sse, sse_error
from core_engine.frontend.openai.tool_calls import ToolChoiceError, ToolPlan, plan_tools
from core_engine.frontend.request_output import CompletionOutput, RequestOutput
from core_engine.proto import SamplingParams


async def create_chat_completion(
    engine: AsyncEngineClient,
    body: ChatCompletionRequest,
    settings: ServerSettings,
    served: ServedModel,
) -> Response | BaseModel:
    """`served`: the base model or the LoRA adapter the body's `model` names."""
    plan = _tool_plan(engine, body, settings)
    params = await _chat_sampling_params(engine, body, plan)
    prompt_token_ids = await _chat_prompt_token_ids(engine, body, plan)
    header = ResponseHeader.new("chatcmpl", served.name)
    stream = submit(
        engine,
        body,
        prompt_token_ids,
        params,
        header.id,
        "messages",
        lora_request=served.lora_request,
    )
    if body.stream:
        events = _chat_events(engine, body, plan, stream, header)
        return StreamingResponse(events, media_type="text/event-stream")
    (final,) = await final_outputs([stream])
    return _chat_response(engine, body, plan, final, header)


def _tool_plan(
    engine: AsyncEngineClient, body: ChatCompletionRequest, settings: ServerSettings
) -> ToolPlan:
    template = engine.tokenizer.chat_template or ""
    try:
        return plan_tools(body, settings.tool_call_parser, "tools" in template)
    except ToolChoiceError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


async def _chat_sampling_params(
    engine: AsyncEngineClient, body: ChatCompletionRequest, plan: ToolPlan
) -> SamplingParams:
    """The body's sampling parameters, constrained by its tool choice where that constrains the
    output (which no other output constraint may then do); 400 for a constraint the engine
    cannot apply."""
    params = sampling_params(body)
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
    await check_output_constraint(engine, params, constraint_field)
    return params


async def _chat_prompt_token_ids(
    engine: AsyncEngineClient, body: ChatCompletionRequest, plan: ToolPlan
) -> list[int]:
    """The conversation through the chat template (on a thread); its errors are 400s."""
    try:
        return await asyncio.to_thread(
            engine.apply_chat_template,
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            **plan.template_kwargs(),
        )
    except InvalidPromptError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the user's
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc


def _chat_response(
    engine: AsyncEngineClient,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    final: RequestOutput,
    header: ResponseHeader,
) -> ChatCompletionResponse:
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
        **header.fields(),
        choices=choices,
        usage=usage([final]),
        prompt_logprobs=(
            vllm_prompt_logprobs(engine, final) if body.prompt_logprobs is not None else None
        ),
        kv_transfer_params=final.kv_transfer_params,
    )


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
    header: ResponseHeader,
) -> AsyncIterator[str]:
    """SSE chunks: the assistant role for every choice, then content deltas; usage; [DONE].

    A named tool call streams its arguments as they come; "required" and "auto" replies are
    read whole (a call is only known once it is complete) and sent as one delta at the end."""

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        response = ChatCompletionStreamResponse(**header.fields(), choices=choices, usage=usage)
        return sse(response)

    final = None
    texts = [""] * body.n  # replies read whole ("required", "auto")
    try:
        first = _first_deltas(plan, body.n)
        yield chunk([ChatCompletionStreamChoice(index=i, delta=d) for i, d in enumerate(first)])
        async for _, output in merge_outputs([stream]):
            choices = _stream_choices(engine, body, plan, output, texts)
            final = output
            if choices:
                yield chunk(choices)
            if (error := request_failed_error(output)) is not None:
                yield sse_error(error)
        if body.include_usage_in_stream and final is not None:
            yield chunk([], usage([final]))
    except (EngineDeadError, ServiceStoppedError) as exc:
        yield sse_error(unavailable_error(exc))
    yield SSE_DONE


def _first_deltas(plan: ToolPlan, n: int) -> list[DeltaMessage]:
    """Every choice's first delta: the assistant role, and a named call's id and name."""
    first = [DeltaMessage(role="assistant", content="") for _ in range(n)]
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
    return first


def _stream_choices(
    engine: AsyncEngineClient,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    output: RequestOutput,
    texts: list[str],
) -> list[ChatCompletionStreamChoice]:
    """The choices of one update that have a delta or a finish reason to send."""
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
    return choices


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
