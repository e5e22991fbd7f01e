"""POST /v1/completions: the request (`CompletionRequest`) and its response and stream
chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from core_engine.frontend.openai.protocol.base import (
    PromptLogprobs,
    UsageInfo,
    parameter_error,
    refusing,
)
from core_engine.frontend.openai.protocol.sampling_fields import SamplingFields
from core_engine.proto import SamplingParams
from core_engine.proto.sampling_params import MAX_LOGPROBS

# Tools work on the chat endpoint only (the completions API has none).
COMPLETION_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
}


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of them, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _reject_empty_prompt(cls, value: str | list) -> str | list:
        if len(value) == 0 or any(isinstance(item, list) and not item for item in value):
            raise ValueError("prompt must not be empty")
        return value

    tools: Any = None
    tool_choice: Any = None

    _refuse_tools = refusing(COMPLETION_NOT_SUPPORTED)

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise parameter_error(
                "best_of", f"best_of must equal n ({self.n}) on this server, got {self.best_of}"
            )
        return self

    @model_validator(mode="after")
    def _one_prompt_with_kv_transfer(self) -> CompletionRequest:
        if self.kv_transfer_params is not None and len(self.prompts()) > 1:
            raise parameter_error(
                "kv_transfer_params",
                "kv_transfer_params hands over one prompt's KV: send one prompt, got "
                f"{len(self.prompts())}",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one entry per string or per token id list."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not (self.echo and not self.stream):
            raise parameter_error(
                "max_tokens",
                "max_tokens: 0 is for scoring a prompt (echo: true, not streamed); otherwise it "
                "must be at least 1",
            )
        return self

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0 with echo: lm-eval-harness's loglikelihood request, no generation."""
        return self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """echo with logprobs asks for the prompt's logprobs too; max_tokens 0 generates one
        token (the engine always samples once) that the response leaves out."""
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if self.prompt_logprobs is not None:
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        max_tokens = 1 if self.scores_prompt_only else self.max_tokens
        return self._make_sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs; with echo the prompt's tokens come first, the very first
    with None (nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int  # one value for every chunk of a response (ResponseHeader)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
