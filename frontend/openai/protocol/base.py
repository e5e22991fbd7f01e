"""What every OpenAI model shares: `OpenAIModel` (unknown fields accepted, logged once per
name), `RequestBody` (no text UTF-8 cannot encode, anywhere), the refusal of unsupported
fields, and the pieces both endpoints answer with (`UsageInfo`, `PromptLogprob`)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core_engine.frontend.text.unicode_text import find_text_not_utf8

logger = logging.getLogger(__name__)


NonNegativeInt = Annotated[int, Field(ge=0)]


# The wire carries `priority` as a msgpack int64.
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


# The pydantic error type of text that cannot be encoded as UTF-8; its ctx names the JSON path.
TEXT_NOT_UTF8 = "text_not_utf8"
# The pydantic error type of a check across fields; its ctx names the field it blames.
PARAMETER_ERROR = "parameter_error"


def parameter_error(param: str, message: str) -> PydanticCustomError:
    """What a model validator raises for a check across fields: the error body's `param` is
    `param`, carried in the error's context, never recovered from the message."""
    return PydanticCustomError(PARAMETER_ERROR, "{message}", {"param": param, "message": message})


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


def refusing(table: dict[str, tuple[Any, ...]]) -> Any:
    """A validator for the fields of `table` that lets only their neutral values through."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(value, info.field_name, table[info.field_name])

    return field_validator(*table)(classmethod(refuse))


def _refuse_unless_neutral(value: Any, field: str, neutral: tuple[Any, ...]) -> Any:
    if any(value == allowed for allowed in neutral):
        return value
    accepted = "leave it out" if neutral == (None,) else f"accepted only as {neutral[-1]!r}"
    raise ValueError(f"{field} is not supported by this server ({accepted})")


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


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every body of one response carries unchanged, whole or chunk by chunk: its `id`,
    the `model` name and `created` (Unix seconds, taken once when the request arrived)."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, id_prefix: str, model: str) -> ResponseHeader:
        return cls(id=random_id(id_prefix), model=model, created=int(time.time()))

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "created": self.created}
