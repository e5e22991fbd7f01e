"""POST /v1/completions: one engine request per prompt (`n` choices each), answered whole or
as server-sent events; `echo` prepends the prompt (with its logprobs if asked), and
`max_tokens: 0` with `echo` scores the prompt only."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from core_engine.frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    Prompt,
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
from core_engine.frontend.openai.logprobs import (
    append_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from core_engine.frontend.openai.output_streams import final_outputs, merge_outputs
from core_engine.frontend.openai.protocol.base import ResponseHeader, UsageInfo
from core_engine.frontend.openai.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from core_engine.frontend.openai.served_models import ServedModel
from core_engine.frontend.openai.sse import SSE_DONE, sse, sse_error
from core_engine.frontend.request_output import RequestOutput


async def create_completion(
    engine: AsyncEngineClient, body: CompletionRequest, served: ServedModel
) -> Response | BaseModel:
    """`served`: the base model or the LoRA adapter the body's `model` names."""
    params = sampling_params(body)
    await check_output_constraint(engine, params, body.structured_outputs_field()[1])
    header = ResponseHeader.new("cmpl", served.name)
    prompts = body.prompts()
    token_ids = [await _tokenize(engine, prompt) for prompt in prompts]
    streams = [
        submit(
            engine,
            body,
            prompt,
            params,
            f"{header.id}-{index}",
            "prompt",
            ids,
            lora_request=served.lora_request,
        )
        for index, (prompt, ids) in enumerate(zip(prompts, token_ids, strict=True))
    ]
    if body.stream:
        events = _completion_events(engine, body, streams, header)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await final_outputs(streams)
    choices = _completion_choices(engine, body, finals)
    total_usage = usage(finals)
    if body.scores_prompt_only:
        total_usage = UsageInfo.of(total_usage.prompt_tokens, 0)
    return CompletionResponse(
        **header.fields(),
        choices=choices,
        usage=total_usage,
        kv_transfer_params=finals[0].kv_transfer_params,
    )


def _completion_choices(
    engine: AsyncEngineClient, body: CompletionRequest, finals: list[RequestOutput]
) -> list[CompletionChoice]:
    """Every prompt's `n` choices, numbered prompt by prompt."""
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
    return choices


async def _completion_events(
    engine: AsyncEngineClient,
    body: CompletionRequest,
    streams: list[AsyncIterator[RequestOutput]],
    header: ResponseHeader,
) -> AsyncIterator[str]:
    """SSE chunks, one per request update; usage last if asked; then [DONE]."""
    finals: dict[int, RequestOutput] = {}
    choice_to_offset: dict[int, int] = {}  # text offset of the next token, for logprobs
    try:
        async for prompt_index, output in merge_outputs(streams):
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
            yield sse(CompletionResponse(**header.fields(), choices=choices))
            if (error := request_failed_error(output)) is not None:
                yield sse_error(error)
        if body.include_usage_in_stream:
            total_usage = usage(list(finals.values()))
            yield sse(CompletionResponse(**header.fields(), choices=[], usage=total_usage))
    except (EngineDeadError, ServiceStoppedError) as exc:
        yield sse_error(unavailable_error(exc))
    yield SSE_DONE


async def _tokenize(engine: AsyncEngineClient, prompt: Prompt) -> list[int]:
    """A completion prompt's tokens, computed off the event loop; 400 for a bad prompt."""
    try:
        return await engine.tokenize_in_thread(prompt)
    except InvalidPromptError as exc:
        raise APIError(400, str(exc), param="prompt") from exc


def _prompt_text(engine: AsyncEngineClient, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return engine.tokenizer.decode(output.prompt_token_ids)
