"""POST /v1/chat/completions: messages, the request (`ChatCompletionRequest`), its response,
logprobs and stream chunks."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from core_engine.frontend.openai.protocol.base import (
    OpenAIModel,
    PromptLogprobs,
    UsageInfo,
    parameter_error,
    refusing,
)
from core_engine.frontend.openai.protocol.sampling_fields import SamplingFields
from core_engine.frontend.openai.protocol.tools import (
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from core_engine.proto import SamplingParams
from core_engine.proto.sampling_params import MAX_LOGPROBS

CHAT_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
}


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def for_template(self) -> dict[str, Any]:
        """Role and text, plus a name, a tool call id or the tool calls where the message has
        them; a call's JSON arguments become a dict, which tool-aware templates iterate."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. No max_tokens means "up to the context window"."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None

    _refuse_chat_not_supported = refusing(CHAT_NOT_SUPPORTED)

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise parameter_error("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them: role and text, plus a name or a tool
        call id where the message has one."""
        return [m.for_template() for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._make_sampling_params(self.max_output_tokens, logprobs)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # one value for every chunk of a response (ResponseHeader)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int  # one value for every chunk of a response (ResponseHeader)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
