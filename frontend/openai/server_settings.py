"""`ServerSettings`: how the OpenAI server presents the engine (name, key, limits)."""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.frontend.openai.lora_modules import LoRAModulePath

# Larger bodies get a 413 before they are read: a whole-context prompt as JSON token ids fits
# many times over.
DEFAULT_MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class ServerSettings:
    """How the server presents the engine. `served_model_names`: every name a request may give
    as `model` (responses carry the first). `log_stats_interval_s` None disables the stats log.
    `lora_modules`: the LoRA adapters loaded once the engine is ready (a bad one stops the
    start-up); `allow_runtime_lora_updating`: serve POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter (404 otherwise, as routes that do not exist)."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    log_stats_interval_s: float | None = 10.0
    tool_call_parser: str | None = None  # reads tool calls back for tool_choice "auto"
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_web_ui: bool = True  # the page at /; GET /engine/state is served either way
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")

    @property
    def served_model_name(self) -> str:
        """The name responses carry: the first served name."""
        return self.served_model_names[0]
