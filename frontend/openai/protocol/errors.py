"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    field_validator,
)

from core_engine.frontend.text.unicode_text import printable_text


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
