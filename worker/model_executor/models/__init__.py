"""Model definitions, looked up by the HF architecture name in `ModelConfig.architecture`."""

from __future__ import annotations

from torch import nn

from core_engine.worker.model_executor.model_config import SUPPORTED_ARCHITECTURES
from core_engine.worker.model_executor.models.gemma3 import Gemma3ForCausalLM
from core_engine.worker.model_executor.models.llama import LlamaForCausalLM

# Every other supported architecture is the Llama-family definition with different flags.
ARCHITECTURE_TO_MODEL_CLASS = {
    **dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM),
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The nn.Module class for `architecture`; ValueError listing the supported ones."""
    if architecture not in ARCHITECTURE_TO_MODEL_CLASS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(ARCHITECTURE_TO_MODEL_CLASS)}"
        )
    return ARCHITECTURE_TO_MODEL_CLASS[architecture]


__all__ = [
    "ARCHITECTURE_TO_MODEL_CLASS",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "get_model_class",
]
