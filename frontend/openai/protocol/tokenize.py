"""vLLM's POST /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    model_validator,
)

from core_engine.frontend.openai.protocol.base import NonNegativeInt, RequestBody
from core_engine.frontend.openai.protocol.chat import ChatMessage


class TokenizeRequest(RequestBody):
    """POST /tokenize (vLLM's): a text `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[NonNegativeInt]


class DetokenizeResponse(BaseModel):
    prompt: str
