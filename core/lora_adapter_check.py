"""`LoRAAdapterCheck`: the engine core's own check of the adapter a request names, so that a
client that skips the frontend's check cannot make a worker fail on a bad checkpoint."""

from __future__ import annotations

from core_engine.common.lora_checkpoint import LoRACheckpointError, check_lora_checkpoint
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.proto.parameter_error import ParameterError

# Adapters (id, path) whose verdict is remembered; past it the oldest is forgotten.
MAX_REMEMBERED_ADAPTERS = 1024


class LoRAAdapterCheck:
    """Checks each (id, path) once from the checkpoint's headers against `shapes` (None: the
    engine runs without enable_lora, and every adapter is refused)."""

    def __init__(self, shapes: LoRATargetShapes | None) -> None:
        self.shapes = shapes
        self._verdicts: dict[tuple[int, str], str | None] = {}

    def check(self, lora_request: LoRARequest | None) -> None:
        """ParameterError on `model` naming the adapter and what is wrong with it."""
        if lora_request is None:
            return
        if self.shapes is None:
            raise ParameterError(
                "model",
                f"LoRA adapter {lora_request.lora_name!r}: the engine runs without enable_lora "
                "(start it with --enable-lora)",
            )
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._verdicts:
            if len(self._verdicts) >= MAX_REMEMBERED_ADAPTERS:
                del self._verdicts[next(iter(self._verdicts))]
            self._verdicts[key] = self._problem(lora_request)
        problem = self._verdicts[key]
        if problem is not None:
            raise ParameterError("model", f"LoRA adapter {lora_request.lora_name!r}: {problem}")

    def _problem(self, lora_request: LoRARequest) -> str | None:
        try:
            check_lora_checkpoint(lora_request.lora_path, self.shapes, self.shapes.max_rank)
        except LoRACheckpointError as exc:
            return str(exc)
        return None
