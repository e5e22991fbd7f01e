"""Reads a GGUF file as if it were a Hugging Face checkpoint: config dict + HF-named tensors.

Every tensor is dequantized to float32 with the `gguf` package (Q4_1, Q8_0, K-quants, F16, ...)
and renamed to its transformers name. llama.cpp stores the Q and K projections of the `llama`
architecture with rows permuted for its interleaved RoPE; `iter_gguf_weights` undoes that, so
the weights match the HF layout that `worker.layers.RotaryEmbedding` (rotate-half) expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.model_config import ModelConfig, model_config_from_dicts

GGUF_ARCHITECTURE_TO_HF = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose Q/K rows llama.cpp's converter permutes (the NEOX-rope ones it leaves).
PERMUTED_QK_ARCHITECTURES = ("llama",)

GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ GGUFs store RoPE scaling as per-frequency divisors in this tensor.
ROPE_FREQS_TENSOR_NAME = "rope_freqs.weight"
# llama.cpp's file types whose weights are all unquantized, as HF dtype names.
FILE_TYPE_TO_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}


def open_gguf(path: Path):
    """Opens `path` with gguf.GGUFReader (memory-mapped; tensors are read lazily).

    Raises FileNotFoundError if missing, ValueError if the file is not a readable GGUF.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {error}") from error


def gguf_model_config(reader) -> ModelConfig:
    """The ModelConfig of an open GGUF file (metadata + tensor names)."""
    return model_config_from_dicts(*gguf_to_hf_config(reader))


def gguf_to_hf_config(reader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json-style dict, generation_config.json-style dict) from GGUF metadata.

    Raises ValueError naming the architecture or feature when the file cannot be served.
    """
    arch = read_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURE_TO_HF:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(GGUF_ARCHITECTURE_TO_HF)}"
        )
    tensor_shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    num_attention_heads = int(_arch_field(reader, arch, "attention.head_count"))
    num_key_value_heads = _arch_field(reader, arch, "attention.head_count_kv", num_attention_heads)
    if isinstance(num_key_value_heads, list):
        raise ValueError("GGUF files with a per-layer attention.head_count_kv are not supported")
    hidden_size = int(_arch_field(reader, arch, "embedding_length"))
    head_dim = int(
        _arch_field(reader, arch, "attention.key_length", hidden_size // num_attention_heads)
    )
    rope_dim = int(_arch_field(reader, arch, "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope dims {rope_dim} of {head_dim}) are not supported"
        )
    hf_config = {
        "architectures": [GGUF_ARCHITECTURE_TO_HF[arch]],
        "vocab_size": tensor_shapes["token_embd.weight"][1],
        "hidden_size": hidden_size,
        "intermediate_size": int(_arch_field(reader, arch, "feed_forward_length")),
        "num_hidden_layers": int(_arch_field(reader, arch, "block_count")),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": int(num_key_value_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_arch_field(reader, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_arch_field(reader, arch, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_freq_factors(reader) or _rope_scaling(reader, arch),
        "max_position_embeddings": int(_arch_field(reader, arch, "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "torch_dtype": FILE_TYPE_TO_DTYPE.get(read_field(reader, "general.file_type")),
    }
    generation_config = {
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [
            token_id
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (token_id := read_field(reader, f"tokenizer.ggml.{key}")) is not None
        ],
    }
    return hf_config, generation_config


def iter_gguf_weights(reader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF parameter name, float32 CPU tensor in HF layout) for every GGUF tensor.

    Raises ValueError for a tensor with no HF counterpart.
    """
    import gguf

    arch = read_field(reader, "general.architecture")
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME:  # read into the config instead
            continue
        hf_name = gguf_to_hf_tensor_name(tensor.name)
        weights = np.asarray(
            gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
        )
        if arch in PERMUTED_QK_ARCHITECTURES:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                weights = unpermute_qk_rows(weights, config.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                weights = unpermute_qk_rows(weights, config.num_key_value_heads)
        yield hf_name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


def gguf_to_hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, etc."""
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    match = LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSOR_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[kind]}.{suffix}"


def unpermute_qk_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, half) -> (half, pair).

    llama.cpp interleaves each head's two rotary halves; HF keeps them as two blocks.
    """
    rows_per_half = weights.shape[0] // num_heads // 2
    per_head = weights.reshape(num_heads, rows_per_half, 2, *weights.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def read_field(reader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list; `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch_field(reader, arch: str, key: str, default: Any = None) -> Any:
    value = read_field(reader, f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"GGUF metadata has no {arch}.{key}")
    return value


def _rope_freq_factors(reader) -> dict[str, Any] | None:
    """{"rope_type": "gguf_freq_factors", "freq_factors": [...]} from the rope_freqs tensor.

    llama.cpp divides each RoPE frequency by its factor, which is how it encodes Llama 3's
    frequency-dependent scaling (the scaling parameters themselves are not in the metadata).
    """
    import gguf

    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME:
            factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            return {
                "rope_type": "gguf_freq_factors",
                "freq_factors": [float(f) for f in factors.reshape(-1)],
            }
    return None


def _rope_scaling(reader, arch: str) -> dict[str, Any] | None:
    rope_type = read_field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type}
    factor = read_field(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = read_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
