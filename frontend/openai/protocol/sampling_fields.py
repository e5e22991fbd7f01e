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
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from core_engine.frontend.openai.protocol.base import (
    NonNegativeInt,
    OpenAIModel,
    Priority,
    RequestBody,
    parameter_error,
    refusing,
)
from core_engine.proto import SamplingParams
from core_engine.proto.kv_transfer_params import KVTransferParams
from core_engine.proto.parameter_error import ParameterError
from core_engine.proto.sampling_params import MAX_LOGPROBS, StructuredOutputs

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


# Accepted and without effect here, and why.
IGNORED = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing to monitor here",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "store": "OpenAI's storage of completions; nothing is stored",
    "service_tier": "OpenAI's processing tiers; one tier here",
}


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
            raise parameter_error(
                "response_format",
                'response_format gives json_schema exactly when type is "json_schema"',
            )
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
    kv_transfer_params: dict[str, Any] | None = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    modalities: Any = None

    _refuse_not_supported = refusing(NOT_SUPPORTED)

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
            raise parameter_error(
                "stream_options",
                "stream_options: only allowed with stream: true (this request has stream: false)",
            )
        return self

    def structured_outputs_field(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint and the field that asked for it (`response_format`,
        `structured_outputs` or vLLM's older `guided_*`); ParameterError if several do."""
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
            raise ParameterError(
                asked[1][1], f"{asked[1][1]}: give one output constraint, got {names}"
            )
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
            kv_transfer_params=KVTransferParams.parse(self.kv_transfer_params),
            **{name: value for name, value in optional.items() if value is not None},
        )


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
