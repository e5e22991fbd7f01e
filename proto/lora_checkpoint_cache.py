"""`LoRACheckpointCache`: the LoRA adapter checkpoints one engine has found good, so that a bad
adapter is refused when a request is submitted (a `ParameterError` naming what is wrong), never
as a failure inside the engine, and a good one is read from disk once. The frontend checks with
it before a request leaves, the engine core again for clients that skip the frontend."""

from __future__ import annotations

from core_engine.common.lora_checkpoint import (
    LoRAAdapterConfig,
    LoRACheckpointError,
    check_lora_checkpoint,
)
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.proto.parameter_error import ParameterError

# The parameter a refused adapter is blamed on (`ParameterError.param`).
LORA_REQUEST_PARAM = "lora_request"


class LoRACheckpointCache:
    """Checks adapter checkpoints against the served model's `shapes` (their module shapes,
    layer count and largest rank, as the engine reports them), once per (lora_int_id,
    lora_path).

    Invariant: a `lora_int_id` names one path. The workers keep an adapter's weights by its id,
    so a second path under an id already checked is refused: it would run with the first
    path's weights. Only good checkpoints are kept; a bad one is read again on the next try
    (its files may have been fixed since).
    """

    def __init__(self, shapes: LoRATargetShapes, param: str = LORA_REQUEST_PARAM) -> None:
        """`param`: the request field a refusal is blamed on."""
        self.shapes = shapes
        self.param = param
        self._key_to_config: dict[tuple[int, str], LoRAAdapterConfig] = {}
        self._id_to_path: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._key_to_config)

    def check(self, lora_request: LoRARequest) -> LoRAAdapterConfig:
        """The adapter's config; ParameterError (param "lora_request") naming the adapter and
        what is wrong with it (param `self.param`): its id taken by another path, or a bad
        checkpoint."""
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if (config := self._key_to_config.get(key)) is not None:
            return config
        self._check_id_is_free(lora_request)
        try:
            config = check_lora_checkpoint(
                lora_request.lora_path, self.shapes, self.shapes.max_rank
            )
        except LoRACheckpointError as exc:
            raise ParameterError(
                self.param, f"LoRA adapter {lora_request.lora_name!r}: {exc}"
            ) from exc
        self._id_to_path.setdefault(lora_request.lora_int_id, lora_request.lora_path)
        self._key_to_config[key] = config
        return config

    def _check_id_is_free(self, lora_request: LoRARequest) -> None:
        known_path = self._id_to_path.get(lora_request.lora_int_id)
        if known_path is not None and known_path != lora_request.lora_path:
            raise ParameterError(
                self.param,
                f"LoRA adapter {lora_request.lora_name!r}: lora_int_id "
                f"{lora_request.lora_int_id} already names the adapter at {known_path}, whose "
                f"weights the engine keeps under that id; give {lora_request.lora_path} an id "
                "of its own",
            )
