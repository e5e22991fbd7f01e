"""`ServedModels`: what a request's `model` may name (the base model under each of its served
names, or a loaded LoRA adapter), what it resolves to, and the cards /v1/models lists."""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.frontend.lora_adapter_registry import LoRAAdapter, LoRAAdapterRegistry
from core_engine.frontend.openai.api_error import APIError
from core_engine.frontend.openai.protocol.models import ModelCard
from core_engine.proto import LoRARequest


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a request runs on: `name` is what its response carries as `model` (the base
    model's first served name, or the adapter's name), `lora_request` its adapter (None: the
    base model)."""

    name: str
    lora_request: LoRARequest | None = None


class ServedModels:
    """A view of what is served now: the base model's served names (responses carry the first)
    and the adapters of `lora_adapters` (None: no adapters), which may change while the server
    runs."""

    def __init__(
        self, base_model_names: tuple[str, ...], lora_adapters: LoRAAdapterRegistry | None = None
    ) -> None:
        self.base_model_names = base_model_names
        self.lora_adapters = lora_adapters

    def resolve(self, model: str | None) -> ServedModel:
        """The model a request names (None: the base model); 404 naming everything served."""
        if model is None or model in self.base_model_names:
            return ServedModel(self.base_model_names[0])
        adapters = self.lora_adapters
        lora_request = adapters.resolve(model) if adapters is not None else None
        if lora_request is not None:
            return ServedModel(model, lora_request)
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves {self._describe()}",
            param="model",
            code="model_not_found",
        )

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """The base model under each served name, then every adapter (vLLM's shape: `parent`
        its base model's name, `root` its path)."""
        cards = [ModelCard(id=name, max_model_len=max_model_len) for name in self.base_model_names]
        cards.extend(
            ModelCard(
                id=adapter.name,
                root=adapter.path,
                parent=adapter.base_model_name or self.base_model_names[0],
                max_model_len=max_model_len,
            )
            for adapter in self._adapters()
        )
        return cards

    def card(self, model: str, max_model_len: int) -> ModelCard:
        """The card of one served name or adapter; 404 for anything else."""
        self.resolve(model)
        return next(card for card in self.cards(max_model_len) if card.id == model)

    def _describe(self) -> str:
        served = ", ".join(f"`{name}`" for name in self.base_model_names)
        adapters = ", ".join(f"`{adapter.name}`" for adapter in self._adapters())
        return f"{served} and the LoRA adapters {adapters}" if adapters else served

    def _adapters(self) -> list[LoRAAdapter]:
        return self.lora_adapters.adapters if self.lora_adapters is not None else []
