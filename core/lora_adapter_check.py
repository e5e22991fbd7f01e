"""`LoRAAdapterCheck`: the engine core's own check of the adapter a request names, so that a
client that skips the frontend's check cannot make a worker fail on a bad checkpoint. The
checks and what is remembered are the frontend's (`proto.lora_checkpoint_cache`)."""

from __future__ import annotations

from core_engine.proto.lora_checkpoint_cache import LoRACheckpointCache
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.proto.parameter_error import ParameterError

# The request field a refused adapter is blamed on: the core knows adapters by request only.
PARAM = "model"


class LoRAAdapterCheck:
    """Checks each adapter against `shapes` (None: the engine runs without enable_lora, and
    every adapter is refused)."""

    def __init__(self, shapes: LoRATargetShapes | None) -> None:
        self._checkpoints = LoRACheckpointCache(shapes, PARAM) if shapes is not None else None

    def check(self, lora_request: LoRARequest | None) -> None:
        """ParameterError on `model` naming the adapter and what is wrong with it."""
        if lora_request is None:
            return
        if self._checkpoints is None:
            raise ParameterError(
                PARAM,
                f"LoRA adapter {lora_request.lora_name!r}: the engine runs without enable_lora "
                "(start it with --enable-lora)",
            )
        self._checkpoints.check(lora_request)
