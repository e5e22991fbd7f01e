"""LoRA adapters on the wire: which adapter a request runs with, and the shapes an adapter's
matrices must have for the model being served.

`LoRARequest` is vLLM's (`LoRARequest(lora_name, lora_int_id, lora_path)`): the name is what
clients put in `model` and what block hashes are keyed by, the int id is the adapter's identity
in the engine (one id, one set of weights), the path is a PEFT checkpoint folder every worker
can read (`adapter_config.json` + `adapter_model.safetensors`).
"""

from __future__ import annotations

import msgspec

from core_engine.common.lora_checkpoint import LORA_TARGET_MODULES

__all__ = ["LORA_TARGET_MODULES", "LoRARequest", "LoRATargetShapes"]


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An adapter a request runs with; `lora_int_id` >= 1 (0 is the base model in vLLM)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must not be empty")


class LoRATargetShapes(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What an adapter of the served model may hold: for each target module (see
    `LORA_TARGET_MODULES`) its (in_features, out_features) in the unsharded model, the same in
    every layer, how many decoder layers there are, and the largest rank (`max_lora_rank`).
    The workers report it; the frontend checks a checkpoint against it before a request or a
    load reaches the engine, and the engine core again for clients that skip the frontend."""

    num_layers: int
    modules: dict[str, tuple[int, int]]
    max_rank: int = 16
