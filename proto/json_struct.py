"""One reading of a config struct given as a struct, a dict or JSON text (a CLI flag's value)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

StructT = TypeVar("StructT", bound=msgspec.Struct)


def parse_json_struct(
    cls: type[StructT], value: StructT | dict[str, Any] | str | None, name: str
) -> StructT | None:
    """`value` as a validated `cls`; None stays None. Raises ValueError naming `name` and, for a
    bad field, the field (msgspec's path)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {name}: {exc}") from exc
