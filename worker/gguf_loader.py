"""Reads a GGUF file as if it were a Hugging Face checkpoint: config dict + HF-named tensors.

Every tensor is dequantized to float32 with the `gguf` package (Q4_1, Q8_0, K-quants, F16, ...)
and renamed to its transformers name. llama.cpp stores the Q and K projections of the `llama`
architecture with rows permuted for its interleaved RoPE; `iter_gguf_weights` undoes that, so
the weights match the HF layout that `worker.layers.RotaryEmbedding` (rotate-half) expects.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from common.eos_tokens import gguf_eos_token_ids
from common.gguf_file import GGUFFile, GGUFTensorInfo
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
# ggml types stored as plain elements (the rest are blocks of quantized values).
ELEMENT_DTYPES = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def gguf_model_config(gguf_file: GGUFFile) -> ModelConfig:
    """The ModelConfig of an open GGUF file (metadata + tensor names)."""
    return model_config_from_dicts(*gguf_to_hf_config(gguf_file))


def gguf_to_hf_config(gguf_file: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json-style dict, generation_config.json-style dict) from GGUF metadata.

    Raises ValueError naming the architecture or feature when the file cannot be served.
    """
    arch = gguf_file.field("general.architecture")
    if arch not in GGUF_ARCHITECTURE_TO_HF:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(GGUF_ARCHITECTURE_TO_HF)}"
        )
    tensor_shapes = {tensor.name: list(tensor.dims) for tensor in gguf_file.tensors}
    num_attention_heads = int(_arch_field(gguf_file, arch, "attention.head_count"))
    num_key_value_heads = _arch_field(
        gguf_file, arch, "attention.head_count_kv", num_attention_heads
    )
    if isinstance(num_key_value_heads, list):
        raise ValueError("GGUF files with a per-layer attention.head_count_kv are not supported")
    hidden_size = int(_arch_field(gguf_file, arch, "embedding_length"))
    head_dim = int(
        _arch_field(gguf_file, arch, "attention.key_length", hidden_size // num_attention_heads)
    )
    rope_dim = int(_arch_field(gguf_file, arch, "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope dims {rope_dim} of {head_dim}) are not supported"
        )
    hf_config = {
        "architectures": [GGUF_ARCHITECTURE_TO_HF[arch]],
        "vocab_size": tensor_shapes["token_embd.weight"][1],
        "hidden_size": hidden_size,
        "intermediate_size": int(_arch_field(gguf_file, arch, "feed_forward_length")),
        "num_hidden_layers": int(_arch_field(gguf_file, arch, "block_count")),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": int(num_key_value_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(
            _arch_field(gguf_file, arch, "attention.layer_norm_rms_epsilon", 1e-6)
        ),
        "rope_theta": float(_arch_field(gguf_file, arch, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_freq_factors(gguf_file) or _rope_scaling(gguf_file, arch),
        "max_position_embeddings": int(_arch_field(gguf_file, arch, "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "torch_dtype": FILE_TYPE_TO_DTYPE.get(gguf_file.field("general.file_type")),
    }
    generation_config = {
        "bos_token_id": gguf_file.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(gguf_file)),
    }
    return hf_config, generation_config


def iter_gguf_weights(
    gguf_file: GGUFFile, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF parameter name, float32 CPU tensor in HF layout) for every GGUF tensor.

    Raises ValueError for a tensor with no HF counterpart or whose bytes pass the file's end.
    """
    import gguf

    arch = gguf_file.field("general.architecture")
    mapped = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    for tensor in gguf_file.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME:  # read into the config instead
            continue
        hf_name = gguf_to_hf_tensor_name(tensor.name)
        weights = np.asarray(
            gguf.quants.dequantize(tensor_data(mapped, tensor), tensor.type_id), dtype=np.float32
        )
        if arch in PERMUTED_QK_ARCHITECTURES:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                weights = unpermute_qk_rows(weights, config.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                weights = unpermute_qk_rows(weights, config.num_key_value_heads)
        yield hf_name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


def tensor_data(mapped: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """`tensor`'s bytes in `mapped` (the whole file as uint8), shaped as
    `gguf.quants.dequantize` takes them: numpy order, elements for float and integer types,
    rows of quantized blocks as uint8 otherwise."""
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.type_id)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_bytes = math.prod(tensor.dims) * type_size // block_size
    end = tensor.data_offset + num_bytes
    if end > len(mapped):
        raise ValueError(
            f"GGUF tensor {tensor.name!r} needs bytes up to {end}, but the file has {len(mapped)}"
        )
    raw = mapped[tensor.data_offset : end]
    shape = tuple(reversed(tensor.dims))
    element_dtype = ELEMENT_DTYPES.get(qtype.name)
    if element_dtype is not None:
        return raw.view(element_dtype).reshape(shape)
    return raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))


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


def _arch_field(gguf_file: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    value = gguf_file.field(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"GGUF metadata has no {arch}.{key}")
    return value


def _rope_freq_factors(gguf_file: GGUFFile) -> dict[str, Any] | None:
    """{"rope_type": "gguf_freq_factors", "freq_factors": [...]} from the rope_freqs tensor.

    llama.cpp divides each RoPE frequency by its factor, which is how it encodes Llama 3's
    frequency-dependent scaling (the scaling parameters themselves are not in the metadata).
    """
    import gguf

    mapped = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    for tensor in gguf_file.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME:
            factors = gguf.quants.dequantize(tensor_data(mapped, tensor), tensor.type_id)
            return {
                "rope_type": "gguf_freq_factors",
                "freq_factors": [float(f) for f in factors.reshape(-1)],
            }
    return None


def _rope_scaling(gguf_file: GGUFFile, arch: str) -> dict[str, Any] | None:
    rope_type = gguf_file.field(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type}
    factor = gguf_file.field(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = gguf_file.field(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
