"""`ModelConfig`: the flat, validated shape of a Llama-family model, from config.json or GGUF.

Both sources go through one parser: a GGUF file's metadata is first translated into a
config.json-style dict (`worker.model_executor.gguf_loader.gguf_to_hf_config`), so every default and every
check lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core_engine.common.eos_tokens import hf_eos_token_ids
from core_engine.common.json_file import read_json
from core_engine.common.model_files import (
    GENERATION_CONFIG_FILE_NAME,
    HF_CONFIG_FILE_NAME,
)

# Architecture (HF class name) -> model_type, for config.json files without "architectures".
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPE_TO_ARCHITECTURE.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "gguf_freq_factors")
# Architectures with sliding-window layers that the attention here masks exactly (the others'
# windows are not applied, so their max_position_embeddings is clamped to the window).
WINDOWED_ARCHITECTURES = ("Gemma3ForCausalLM",)
# The MLP activation of each architecture (the only one its definition computes).
ARCHITECTURE_TO_ACTIVATION = {"Gemma3ForCausalLM": "gelu_pytorch_tanh"}
DEFAULT_ACTIVATION = "silu"
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model definition needs, already defaulted and checked.

    `attention_bias`: q/k/v projections carry a bias; `attention_output_bias`: o_proj does.
    `rope_scaling` is None for plain RoPE, else a dict with "rope_type" in
    SUPPORTED_ROPE_TYPES and that type's parameters (HF names; "gguf_freq_factors" carries
    llama.cpp's per-frequency divisors as "freq_factors"). `max_position_embeddings` is
    the longest sequence served exactly (clamped to the sliding window when a model outside
    WINDOWED_ARCHITECTURES has one, since its attention here is full). `eos_token_ids` holds every stop id of config.json
    and generation_config.json, first the config's.

    Gemma 3 only: `layer_types[i]` is "sliding_attention" (layer i attends to the last
    `sliding_window` positions, itself included, with RoPE base `rope_local_theta`) or
    "full_attention" (rope_theta, rope_scaling); queries are scaled by
    `query_pre_attn_scalar ** -0.5`; logits are soft-capped at `final_logit_softcapping` when set.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    attention_output_bias: bool = False
    hidden_act: str = DEFAULT_ACTIVATION
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per layer, its attention window in tokens (None: full attention)."""
        if self.layer_types is None:
            return [None] * self.num_hidden_layers
        return [
            self.sliding_window if layer_type == SLIDING_ATTENTION else None
            for layer_type in self.layer_types
        ]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name}={getattr(self, name)} must be > 0")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"model config has {len(self.layer_types)} layer_types for "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            unknown = set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION}
            if unknown:
                raise ValueError(f"unsupported layer_types {sorted(unknown)}")
            if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError(
                    f"sliding_attention layers need sliding_window > 0, got {self.sliding_window}"
                )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )


def load_hf_model_config(path: Path) -> ModelConfig:
    """Reads an HF folder: config.json [+ generation_config.json]. (A GGUF file's config comes
    from `worker.model_executor.gguf_loader.gguf_model_config`; `worker.model_executor.model_loader.load_model_config` takes
    either.)

    Raises FileNotFoundError naming the missing file, ValueError for unsupported models.
    """
    path = Path(path)
    config_path = path / HF_CONFIG_FILE_NAME
    if not config_path.is_file():
        raise FileNotFoundError(
            f"model folder {str(path)!r} has no {HF_CONFIG_FILE_NAME}; expected a Hugging Face "
            "folder or a .gguf file"
        )
    hf_config = read_json(config_path)
    generation_config = read_json(path / GENERATION_CONFIG_FILE_NAME)
    config = model_config_from_dicts(hf_config, generation_config)
    # The tokenizer's view of the eos ids (its own eos first), the one the frontend shares.
    return replace(config, eos_token_ids=hf_eos_token_ids(path))


def model_config_from_dicts(
    hf_config: dict[str, Any], generation_config: dict[str, Any]
) -> ModelConfig:
    """Builds a ModelConfig from config.json and generation_config.json contents."""
    architecture = _architecture(hf_config)
    _reject_unsupported_features(hf_config, architecture)
    num_attention_heads = int(hf_config["num_attention_heads"])
    hidden_size = int(hf_config["hidden_size"])
    rope_theta, rope_scaling = _rope(hf_config)
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = True if is_qwen2 else bool(hf_config.get("attention_bias", False))
    gemma3 = _gemma3_fields(hf_config) if architecture == "Gemma3ForCausalLM" else {}
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf_config["intermediate_size"]),
        num_hidden_layers=int(hf_config["num_hidden_layers"]),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=int(hf_config.get("num_key_value_heads") or num_attention_heads),
        head_dim=int(hf_config.get("head_dim") or hidden_size // num_attention_heads),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_max_position_embeddings(hf_config, architecture),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_output_bias=False if is_qwen2 else attention_bias,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        bos_token_id=_first_id(
            generation_config.get("bos_token_id", hf_config.get("bos_token_id"))
        ),
        eos_token_ids=_eos_token_ids(hf_config, generation_config),
        torch_dtype=hf_config.get("dtype") or hf_config.get("torch_dtype"),
        hidden_act=ARCHITECTURE_TO_ACTIVATION.get(architecture, DEFAULT_ACTIVATION),
        **gemma3,
    )


def _gemma3_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's layer types, local RoPE base, query scale and soft-capping, from a
    transformers-5 config (`rope_parameters` per layer type) or a 4.x one."""
    num_layers = int(hf_config["num_hidden_layers"])
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        period = int(hf_config.get("sliding_window_pattern") or 6)
        layer_types = [
            SLIDING_ATTENTION if (layer + 1) % period else FULL_ATTENTION
            for layer in range(num_layers)
        ]
    local = (hf_config.get("rope_parameters") or {}).get(SLIDING_ATTENTION) or {}
    local_theta = local.get("rope_theta", hf_config.get("rope_local_base_freq", 10000.0))
    softcap = hf_config.get("final_logit_softcapping")
    if hf_config.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 has none)")
    return {
        "sliding_window": int(hf_config["sliding_window"]),
        "layer_types": tuple(layer_types),
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(hf_config.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


def _architecture(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        model_type = hf_config.get("model_type")
        architecture = MODEL_TYPE_TO_ARCHITECTURE.get(model_type, f"model_type={model_type!r}")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _reject_unsupported_features(hf_config: dict[str, Any], architecture: str) -> None:
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "unknown")
        raise ValueError(
            f"quantized checkpoints (quant_method={method!r}) are not supported; use a "
            "float16/bfloat16/float32 checkpoint or a GGUF file"
        )
    supported = ARCHITECTURE_TO_ACTIVATION.get(architecture, DEFAULT_ACTIVATION)
    activation = hf_config.get("hidden_activation") or hf_config.get("hidden_act", supported)
    if activation != supported:
        raise ValueError(
            f"unsupported hidden_act {activation!r} for {architecture}; supported: {supported!r}"
        )
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (Llama-family MLPs here have no bias)")


def _rope(hf_config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers-5 `rope_parameters` or 4.x fields."""
    parameters = dict(hf_config.get("rope_parameters") or {})
    if FULL_ATTENTION in parameters:  # per layer type (Gemma 3): this is the global layers'
        parameters = dict(parameters[FULL_ATTENTION])
    legacy_scaling = hf_config.get("rope_scaling") or {}
    parameters = {**legacy_scaling, **parameters}
    rope_theta = float(parameters.pop("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    parameters.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **parameters}


def _max_position_embeddings(hf_config: dict[str, Any], architecture: str) -> int:
    max_positions = int(hf_config.get("max_position_embeddings", 2048))
    window = hf_config.get("sliding_window")
    if architecture in WINDOWED_ARCHITECTURES:
        return max_positions
    uses_window = (
        hf_config.get("use_sliding_window", False)
        if architecture.startswith("Qwen")
        else window is not None
    )
    if uses_window and window:
        return min(max_positions, int(window))
    return max_positions


def _first_id(value: int | list[int] | None) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _eos_token_ids(hf_config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    eos_token_ids: list[int] = []
    for value in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in eos_token_ids:
                eos_token_ids.append(int(token_id))
    return tuple(eos_token_ids)
