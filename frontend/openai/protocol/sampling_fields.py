"""OpenAI-compatible request and response schemas (pydantic), plus vLLM's extra sampling fields.

Requests validate their own bounds, so a bad value is reported with the field's name and its
limit; `to_sampling_params` turns a valid request into the engine's `SamplingParams`.

Every known field either works or is refused: a field of OpenAI's or vLLM's API that this server
does not implement is accepted only at its neutral value (`NOT_SUPPORTED`), and the few accepted
without effect are listed in `IGNORED` with the reason. Unknown fields follow vLLM: accepted,
without effect, and logged once per name.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from frontend.unicode_text import find_text_not_utf8, printable_text
from proto import SamplingParams
from proto.sampling_params import MAX_LOGPROBS, StructuredOutputs

logger = logging.getLogger(__name__)

NonNegativeInt = Annotated[int, Field(ge=0)]
# The wire carries `priority` as a msgpack int64.
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# The pydantic error type of text that cannot be encoded as UTF-8; its ctx names the JSON path.
TEXT_NOT_UTF8 = "text_not_utf8"


# Fields of OpenAI's and vLLM's request APIs that this server does not implement, with the
# values that ask for nothing (accepted); any other value is refused with a 400 naming the field.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
}
# Tools work on the chat endpoint only (the completions API has none).
COMPLETION_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
CHAT_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
}
# Accepted and without effect here, and why.
IGNORED = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing to monitor here",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "store": "OpenAI's storage of completions; nothing is stored",
    "service_tier": "OpenAI's processing tiers; one tier here",
}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> OpenAIModel:
        for name in self.model_extra or {}:
            key = (type(self).__name__, name)
            if key not in _LOGGED_UNKNOWN_FIELDS:
                _LOGGED_UNKNOWN_FIELDS.add(key)
                logger.warning(
                    "ignored unknown field %r of %s (logged once; it has no effect here)",
                    name,
                    type(self).__name__,
                )
        return self


_LOGGED_UNKNOWN_FIELDS: set[tuple[str, str]] = set()


class RequestBody(OpenAIModel):
    """A whole request body. Before any field is read, every string it carries (object keys
    included, known fields or not) must be encodable as UTF-8: a lone surrogate is a
    `TEXT_NOT_UTF8` error naming its JSON path (`stop[0]`), never a failure further on."""

    @model_validator(mode="before")
    @classmethod
    def _reject_text_not_utf8(cls, data: Any) -> Any:
        found = find_text_not_utf8(data)
        if found is not None:
            path, reason = found
            raise PydanticCustomError(
                TEXT_NOT_UTF8,
                "{path} is not valid Unicode text: {reason}",
                {"path": path, "reason": reason},
            )
        return data


def _refusing(table: dict[str, tuple[Any, ...]]) -> Any:
    """A validator for the fields of `table` that lets only their neutral values through."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(value, info.field_name, table[info.field_name])

    return field_validator(*table)(classmethod(refuse))


def _refuse_unless_neutral(value: Any, field: str, neutral: tuple[Any, ...]) -> Any:
    if any(value == allowed for allowed in neutral):
        return value
    accepted = "leave it out" if neutral == (None,) else f"accepted only as {neutral[-1]!r}"
    raise ValueError(f"{field} is not supported by this server ({accepted})")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format gives json_schema exactly when type is "json_schema"')
        return self


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a regex, a choice of
    strings or an EBNF grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class SamplingFields(RequestBody):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras (repetition_penalty,
    top_k ... skip_special_tokens, priority)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[NonNegativeInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    functions: Any = None
    function_call: Any = None
    guided_whitespace_pattern: Any = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    modalities: Any = None

    _refuse_not_supported = _refusing(NOT_SUPPORTED)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _reject_empty_cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string when given, got ''")
        return value

    @field_validator("stop")
    @classmethod
    def _reject_empty_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if any(not stop for stop in _as_list(value)):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _stream_options_only_with_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError(
                "stream_options: only allowed with stream: true (this request has stream: false)"
            )
        return self

    def structured_outputs_field(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint and the field that asked for it (`response_format`,
        `structured_outputs` or vLLM's older `guided_*`); ValueError if several do."""
        asked: list[tuple[StructuredOutputs, str]] = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            asked.append((StructuredOutputs(json_object=True), "response_format"))
        elif response_format is not None and response_format.json_schema is not None:
            schema = _schema_text(response_format.json_schema.json_schema)
            asked.append((StructuredOutputs(json=schema), "response_format"))
        if self.structured_outputs is not None:
            request = self.structured_outputs
            constraint = StructuredOutputs(
                json=None if request.json_ is None else _schema_text(request.json_),
                json_object=bool(request.json_object),
                regex=request.regex,
                choice=request.choice,
                grammar=request.grammar,
            )
            asked.append((constraint, "structured_outputs"))
        guided = {
            "guided_json": lambda v: StructuredOutputs(json=_schema_text(v)),
            "guided_regex": lambda v: StructuredOutputs(regex=v),
            "guided_choice": lambda v: StructuredOutputs(choice=v),
            "guided_grammar": lambda v: StructuredOutputs(grammar=v),
        }
        for name, make in guided.items():
            value = getattr(self, name)
            if value is not None:
                asked.append((make(value), name))
        if len(asked) > 1:
            names = ", ".join(name for _, name in asked)
            raise ValueError(f"{asked[1][1]}: give one output constraint, got {names}")
        return asked[0] if asked else (None, None)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _make_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=_as_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            structured_outputs=self.structured_outputs_field()[0],
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            bad_words=list(self.bad_words or []),
            cache_salt=self.cache_salt,
            **{name: value for name, value in optional.items() if value is not None},
        )


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

    _refuse_tools = _refusing(COMPLETION_NOT_SUPPORTED)

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) on this server, got {self.best_of}")
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
            raise ValueError(
                "max_tokens: 0 is for scoring a prompt (echo: true, not streamed); otherwise it "
                "must be at least 1"
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


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


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

    _refuse_chat_not_supported = _refusing(CHAT_NOT_SUPPORTED)

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
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


class VersionResponse(BaseModel):
    version: str


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs; with echo the prompt's tokens come first, the very first
    with None (nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


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
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


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
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


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
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "core-engine"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error. Its texts are always encodable (what UTF-8 cannot hold is escaped), so
    that an error body can be sent whatever the request carried."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None

    @field_validator("message", "param")
    @classmethod
    def _escape_text_not_utf8(cls, value: str | None) -> str | None:
        return None if value is None else printable_text(value)


class ErrorResponse(BaseModel):
    error: ErrorInfo


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
