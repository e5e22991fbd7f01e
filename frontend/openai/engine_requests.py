"""From a validated OpenAI body to engine requests: its `SamplingParams`, the check of its
output constraint, submitting each request, and the usage of the finished ones. Every refusal
is an `APIError` naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from core_engine.frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    Prompt,
    ServiceStoppedError,
)
from core_engine.frontend.core_client import EngineDeadError
from core_engine.frontend.openai.api_error import APIError, unavailable_error
from core_engine.frontend.openai.protocol.base import UsageInfo
from core_engine.frontend.openai.protocol.chat import ChatCompletionRequest
from core_engine.frontend.openai.protocol.completions import CompletionRequest
from core_engine.frontend.request_output import RequestOutput
from core_engine.proto import LoRARequest, SamplingParams
from core_engine.proto.lora_checkpoint_cache import LORA_REQUEST_PARAM
from core_engine.proto.parameter_error import ParameterError


def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return body.to_sampling_params()
    except ParameterError as exc:  # named as the engine names it; as the body does, if it can
        param = exc.param if exc.param in type(body).model_fields else None
        raise APIError(400, str(exc), param=param) from exc


async def check_output_constraint(
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


def submit(
    engine: AsyncEngineClient,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: Prompt,
    params: SamplingParams,
    request_id: str,
    prompt_param: str,
    prompt_token_ids: list[int] | None = None,
    *,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[RequestOutput]:
    """Validates and registers one request of `body` (streamed or not, at its priority, with
    the LoRA adapter its `model` names); maps its refusals to 400 (an adapter's to `model`)
    and a dead engine to 503."""
    try:
        return engine.generate(
            prompt,
            params,
            request_id,
            stream=body.stream,
            priority=body.priority,
            prompt_token_ids=prompt_token_ids,
            lora_request=lora_request,
        )
    except (EngineDeadError, ServiceStoppedError) as exc:
        raise unavailable_error(exc) from exc
    except InvalidPromptError as exc:
        body_param = {"prompt": prompt_param, LORA_REQUEST_PARAM: "model"}
        param = body_param.get(exc.param, exc.param)
        raise APIError(400, str(exc), param=param) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def usage(finals: list[RequestOutput]) -> UsageInfo:
    return UsageInfo.of(
        prompt_tokens=sum(final.num_prompt_tokens for final in finals),
        completion_tokens=sum(final.num_generated_tokens for final in finals),
    )
