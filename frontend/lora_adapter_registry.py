"""`LoRAAdapterRegistry`: the LoRA adapters a server offers by name (what clients put in
`model`), each with the `LoRARequest` its requests run with."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core_engine.proto import LoRARequest
from core_engine.proto.parameter_error import ParameterError


class LoRAAdapterNotFoundError(ParameterError):
    """No adapter of that name is loaded (the message names it)."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter: its request, and the base model it belongs to (None: the served
    model's first name)."""

    lora_request: LoRARequest
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_request.lora_name

    @property
    def path(self) -> str:
        return self.lora_request.lora_path


class LoRAAdapterRegistry:
    """Adapter name -> `LoRARequest`.

    Invariants: names are unique and none is a served name of the base model; every load gets
    a new `lora_int_id` from a counter, never reused, so a name unloaded and loaded again runs
    with fresh weights (the workers keep weights by id). Unloading only removes the name:
    requests already running with the adapter finish normally.

    `check_adapter` checks a new adapter before it is served (the engine client's
    `check_lora_request`): a `ParameterError` for a bad checkpoint, a `ValueError` for an engine
    without LoRA. It may read files: call `load` off the event loop, one load or unload at a time.
    """

    def __init__(
        self, check_adapter: Callable[[LoRARequest], object], base_model_names: Sequence[str]
    ) -> None:
        self.check_adapter = check_adapter
        self.base_model_names = tuple(base_model_names)
        self._name_to_adapter: dict[str, LoRAAdapter] = {}
        self._int_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._name_to_adapter)

    def __contains__(self, name: object) -> bool:
        return name in self._name_to_adapter

    @property
    def adapters(self) -> list[LoRAAdapter]:
        """Every loaded adapter, in load order."""
        return list(self._name_to_adapter.values())

    def resolve(self, model_name: str | None) -> LoRARequest | None:
        """The request of the adapter named `model_name`; None for any other name."""
        adapter = self._name_to_adapter.get(model_name) if model_name is not None else None
        return adapter.lora_request if adapter is not None else None

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRAAdapter:
        """Checks the adapter at `path` and serves it as `name`. Raises ParameterError naming
        the field at fault ("lora_name": empty, taken, or the base model's; "lora_path": empty
        or a bad checkpoint; "base_model_name": not served here), ValueError when the engine
        runs without LoRA."""
        self._check_new_name(name)
        if not path:
            raise ParameterError("lora_path", f"LoRA adapter {name!r}: lora_path is empty")
        if base_model_name is not None and base_model_name not in self.base_model_names:
            raise ParameterError(
                "base_model_name",
                f"LoRA adapter {name!r}: base_model_name {base_model_name!r} is not served "
                f"here; the base model's names are {_quoted(self.base_model_names)}",
            )
        lora_request = LoRARequest(name, next(self._int_ids), path)
        try:
            self.check_adapter(lora_request)
        except ParameterError as exc:  # the checkpoint at `path` is at fault
            raise ParameterError("lora_path", str(exc)) from exc
        adapter = LoRAAdapter(lora_request, base_model_name)
        self._name_to_adapter[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Stops serving `name` (running requests finish with it); LoRAAdapterNotFoundError
        naming it if no adapter of that name is loaded."""
        adapter = self._name_to_adapter.pop(name, None)
        if adapter is None:
            loaded = _quoted(self._name_to_adapter) if self._name_to_adapter else "none"
            raise LoRAAdapterNotFoundError(
                "lora_name", f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})"
            )
        return adapter

    def _check_new_name(self, name: str) -> None:
        if not name:
            raise ParameterError("lora_name", "lora_name is empty")
        if name in self.base_model_names:
            raise ParameterError(
                "lora_name",
                f"LoRA adapter name {name!r} is a served name of the base model; give the "
                "adapter another name",
            )
        if (adapter := self._name_to_adapter.get(name)) is not None:
            raise ParameterError(
                "lora_name",
                f"LoRA adapter {name!r} is already loaded (from {adapter.path}); unload it "
                "first to load it again",
            )


def _quoted(names: Sequence[str] | dict[str, object]) -> str:
    return ", ".join(f"`{name}`" for name in names)
