"""Logprobs in the OpenAI server's shapes: the legacy completions object (with the echoed
prompt's tokens first), chat `logprobs.content`, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.openai.protocol.base import PromptLogprob, PromptLogprobs
from core_engine.frontend.openai.protocol.chat import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    TopLogprob,
)
from core_engine.frontend.openai.protocol.completions import CompletionLogprobs
from core_engine.frontend.request_output import CompletionOutput, RequestOutput
from core_engine.proto import TokenLogprobs


def _token_text(engine: AsyncEngineClient, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def append_logprobs(
    engine: AsyncEngineClient,
    result: CompletionLogprobs,
    completion: CompletionOutput,
    text_offset: int,
) -> None:
    """Adds the generated tokens' legacy logprobs; `text_offset` is where the first one's text
    starts."""
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=False):
        token = _token_text(engine, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(logprobs.sampled_logprob)
        result.top_logprobs.append({_token_text(engine, t): lp for t, lp in _top(logprobs)})
        result.text_offset.append(text_offset)
        text_offset += len(token)


def echo_logprobs(engine: AsyncEngineClient, output: RequestOutput) -> CompletionLogprobs:
    """The echoed prompt's legacy logprobs (None for its first token): lm-eval-harness sums
    these to score a continuation."""
    result = CompletionLogprobs()
    text_offset = 0
    prompt_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    for token_id, logprobs in zip(output.prompt_token_ids, prompt_logprobs, strict=True):
        token = _token_text(engine, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if logprobs is None else logprobs.sampled_logprob)
        result.top_logprobs.append(
            None
            if logprobs is None
            else {
                _token_text(engine, token_id): logprobs.sampled_logprob,
                **{_token_text(engine, t): lp for t, lp in _top(logprobs)},
            }
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def vllm_prompt_logprobs(engine: AsyncEngineClient, output: RequestOutput) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: logprob, rank, decoded text} for
    the token itself and the top alternatives; None for the first token."""
    result: PromptLogprobs = []
    prompt_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    for token_id, logprobs in zip(output.prompt_token_ids, prompt_logprobs, strict=True):
        if logprobs is None:
            result.append(None)
            continue
        entries = {
            str(token_id): PromptLogprob(
                logprob=logprobs.sampled_logprob,
                rank=logprobs.sampled_rank,
                decoded_token=_token_text(engine, token_id),
            )
        }
        for rank, (alternative, logprob) in enumerate(_top(logprobs), start=1):
            entries.setdefault(
                str(alternative),
                PromptLogprob(
                    logprob=logprob, rank=rank, decoded_token=_token_text(engine, alternative)
                ),
            )
        result.append(entries)
    return result


def chat_logprobs(engine: AsyncEngineClient, completion: CompletionOutput) -> ChatChoiceLogprobs:
    content = []
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=False):
        token = _token_text(engine, token_id)
        top = [
            TopLogprob(
                token=(text := _token_text(engine, t)), logprob=lp, bytes=list(text.encode())
            )
            for t, lp in _top(logprobs)
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=logprobs.sampled_logprob,
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


def _top(logprobs: TokenLogprobs) -> list[tuple[int, float]]:
    return list(zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True))
