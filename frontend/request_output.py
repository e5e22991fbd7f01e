"""What a caller of the engine gets back for one request: `RequestOutput` holding `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core_engine.proto import LoRARequest, TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` choices of a request.

    In a streamed (delta) output, `text`, `token_ids` and `logprobs` hold only what is new since
    the previous output of the same request; in a final output they hold the whole completion.
    `text` never contains a matched stop string. `finish_reason` is None while the choice runs,
    else "stop" | "length" | "abort" | "error"; `stop_reason` is the stop string or stop token id
    that ended it (None for eos or length).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One update of a request: all its choices (final) or the ones that changed (delta).

    `num_generated_tokens` counts every choice's tokens so far (the `completion_tokens` of
    OpenAI usage); `num_cached_tokens` is how many prompt tokens the prefix cache supplied.
    `error` is set when the engine failed the request (its choices finish with "error").
    `prompt_logprobs` (when asked) has one entry per prompt token, None for the first (nothing
    predicts it); it arrives with the first tokens and stays on every later output.
    `lora_request`: the LoRA adapter the request ran with (None: the base model).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set on the final output of a request a prefill instance holds KV for (a JSON object:
    # where a decode instance pulls it from; `proto.kv_transfer_params`).
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
