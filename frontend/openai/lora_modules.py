"""`LoRAModulePath`: a LoRA adapter core-serve loads at start-up, from a `--lora-modules` value in
either of vLLM's two forms: `name=path`, or a JSON object
`{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name optional)."""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """An adapter served as `name` from the PEFT folder `path`; `base_model_name` is the served
    model name it belongs to (None: the first one), what /v1/models gives as its `parent`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` value; ValueError saying what is wrong with it."""
    if text.lstrip().startswith("{"):
        return _parse_json_form(text)
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise ValueError(
            f"{text!r} is neither name=path nor a JSON object "
            '{"name": ..., "path": ..., "base_model_name": ...}'
        )
    return LoRAModulePath(name, path)


def _parse_json_form(text: str) -> LoRAModulePath:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{text!r} is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{text!r} must be a JSON object")
    unknown = sorted(set(fields) - set(JSON_KEYS))
    if unknown:
        raise ValueError(f"{text!r} has unknown keys {unknown}; the keys are {list(JSON_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(fields.get(key), str) or not fields[key]:
            raise ValueError(f"{text!r} needs a non-empty string {key!r}")
    base_model_name = fields.get("base_model_name")
    if base_model_name is not None and not isinstance(base_model_name, str):
        raise ValueError(f"{text!r}: base_model_name must be a string")
    return LoRAModulePath(fields["name"], fields["path"], base_model_name)
