"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter bodies."""

from __future__ import annotations

from typing import Any

from core_engine.frontend.openai.protocol.base import RequestBody, refusing

# vLLM's load fields this server does not implement, with the values that ask for nothing.
LOAD_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "load_inplace": (None, False),  # a name is reloaded by unloading it first
    "is_3d_lora_weight": (None, False),
}


class LoadLoRAAdapterRequest(RequestBody):
    """Serve the PEFT adapter folder `lora_path` as the model `lora_name`."""

    lora_name: str
    lora_path: str
    load_inplace: Any = None
    is_3d_lora_weight: Any = None

    _refuse_load_not_supported = refusing(LOAD_NOT_SUPPORTED)


class UnloadLoRAAdapterRequest(RequestBody):
    """Stop serving `lora_name` (requests already running with it finish). vLLM's optional
    `lora_int_id` is accepted and has no effect: the name says which adapter."""

    lora_name: str
    lora_int_id: int | None = None
