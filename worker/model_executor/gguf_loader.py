"""Reads a GGUF file as if it were a Hugging Face checkpoint: config dict + HF-named tensors.

Every tensor is dequantized to float32 and renamed to its transformers name: Q4_K and Q6_K (the
bulk of a Q4_K_M file) by this module's vectorized numpy (`dequantize_q4_k`, `dequantize_q6_k`,
bit-exact with the `gguf` package's reference), every other type (Q4_1, Q5_0, Q8_0, F16, ...) by
the `gguf` package. llama.cpp stores the Q and K projections of the `llama` architecture with
rows permuted for its interleaved RoPE; `iter_gguf_weights` undoes that, so the weights match
the HF layout that `worker.model_executor.layers.RotaryEmbedding` (rotate-half) expects. Its Gemma converter
stores every RMSNorm weight as 1 + w; the loader subtracts the 1 again, as transformers does,
so the weights are the HF checkpoint's (whose Gemma norms multiply by 1 + w).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from core_engine.common.eos_tokens import gguf_eos_token_ids
from core_engine.common.gguf_file import GGUFFile, GGUFTensorInfo
from core_engine.kernels.cpu.gguf_matmul import TYPE_NAMES
from core_engine.worker.model_executor.gguf_tensor import GgufTensor
from core_engine.worker.model_executor.model_config import ModelConfig, model_config_from_dicts

GGUF_ARCHITECTURE_TO_HF = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
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
# Gemma 3 has four norms per layer; llama.cpp's `ffn_norm` is its pre-feedforward norm there.
GEMMA3_LAYER_TENSOR_NAMES = {
    **LAYER_TENSOR_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHITECTURE_TO_LAYER_TENSOR_NAMES = {"gemma3": GEMMA3_LAYER_TENSOR_NAMES}
# Architectures whose norm weights llama.cpp's converter stored as 1 + w.
NORM_PLUS_ONE_ARCHITECTURES = ("gemma3",)
# Gemma 3 values that llama.cpp hard-codes instead of writing to the metadata.
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6
LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ GGUFs store RoPE scaling as per-frequency divisors in this tensor.
ROPE_FREQS_TENSOR_NAME = "rope_freqs.weight"
# llama.cpp's file types whose weights are all unquantized, as HF dtype names.
FILE_TYPE_TO_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}
# K-quants: super-blocks of QK_K values (ggml-common.h's block_q4_K and block_q6_K).
QK_K = 256
Q4_K_TYPE_ID, Q6_K_TYPE_ID = 12, 14
Q4_K_BLOCK_BYTES = 2 + 2 + 12 + QK_K // 2  # d, dmin (f16), 8 6-bit scale/min pairs, nibbles
Q6_K_BLOCK_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2  # ql, qh, int8 scales, d (f16)
TYPE_ID_TO_BLOCK_BYTES = {Q4_K_TYPE_ID: Q4_K_BLOCK_BYTES, Q6_K_TYPE_ID: Q6_K_BLOCK_BYTES}
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
    if arch == "gemma3":
        hf_config.update(_gemma3_config(gguf_file, hf_config))
    generation_config = {
        "bos_token_id": gguf_file.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(gguf_file)),
    }
    return hf_config, generation_config


def iter_gguf_weights(
    gguf_file: GGUFFile, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GgufTensor]]:
    """Yields (HF parameter name, float32 CPU tensor in HF layout) for every GGUF tensor; with
    `keep_quantized`, a matrix whose blocks the GGUF matmul takes (`GGUF_MATMUL_TYPES`) comes as
    a `GgufTensor` of those blocks instead (rows in HF order too).

    Raises ValueError for a tensor with no HF counterpart or whose bytes pass the file's end.
    """
    arch = gguf_file.field("general.architecture")
    mapped = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    for tensor in gguf_file.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME:  # read into the config instead
            continue
        hf_name = gguf_to_hf_tensor_name(tensor.name, arch)
        data = tensor_data(mapped, tensor)
        if keep_quantized and len(tensor.dims) == 2 and tensor.type_id in TYPE_NAMES:
            blocks = _hf_rows(data, hf_name, arch, config)
            shape = (tensor.dims[1], tensor.dims[0])
            yield hf_name, GgufTensor(tensor.type_id, torch.from_numpy(blocks.copy()), shape)
            continue
        weights = dequantize(data, tensor.type_id)
        if arch in NORM_PLUS_ONE_ARCHITECTURES and hf_name.endswith("norm.weight"):
            weights = weights - np.float32(1.0)
        weights = _hf_rows(weights, hf_name, arch, config)
        yield hf_name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


def _hf_rows(rows: np.ndarray, hf_name: str, arch: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows (values, or rows of quantized blocks) in HF order: llama.cpp's
    converter permuted the Q and K projections' rows of the `llama` architecture."""
    if arch in PERMUTED_QK_ARCHITECTURES:
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_qk_rows(rows, config.num_attention_heads)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_qk_rows(rows, config.num_key_value_heads)
    return rows


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


def gguf_to_hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, etc. (`arch`: the
    GGUF architecture, which decides what a layer's norms are called)."""
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    layer_names = ARCHITECTURE_TO_LAYER_TENSOR_NAMES.get(arch, LAYER_TENSOR_NAMES)
    match = LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the {arch!r} model")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{layer_names[kind]}.{suffix}"


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [N, 144] Q4_K blocks -> float32 [N, 256].

    Eight sub-blocks of 32 values; sub-block j is `d * scale_j * q - dmin * min_j` with 6-bit
    scale_j/min_j packed in 12 bytes and 4-bit q: sub-blocks 2i and 2i + 1 share the 32 bytes
    i, the low nibbles holding 2i. Computed in ggml's float order, so bit-exact with it.
    """
    num_blocks = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16]
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    # (mins); sub-blocks 4-7 take 4 bits from bytes 8-11 and their top 2 bits from bytes 0-7.
    scales = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=1)
    sub_scale = (d * scales.astype(np.float32))[:, :, None]  # [N, 8, 1]
    sub_min = (dmin * mins.astype(np.float32))[:, :, None]
    nibbles = blocks[:, 16:].reshape(num_blocks, 4, 1, 32)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).reshape(num_blocks, 8, 32)
    return (sub_scale * q.astype(np.float32) - sub_min).reshape(num_blocks, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [N, 210] Q6_K blocks -> float32 [N, 256].

    Sixteen sub-blocks of 16 values, value = d * scale_j * (q - 32) with int8 scale_j and 6-bit
    q: its low 4 bits in `ql`, its high 2 in `qh`. Each half of 128 values reads 64 bytes of ql
    and 32 of qh: for l < 32, values l, l + 32, l + 64, l + 96 are the low nibbles of ql[l],
    ql[l + 32], then their high nibbles, each with bits 0-1, 2-3, 4-5, 6-7 of qh[l].
    Computed in ggml's float order, so bit-exact with it.
    """
    num_blocks = blocks.shape[0]
    ql = blocks[:, : QK_K // 2].reshape(num_blocks, 2, 2, 32)  # [N, half, ql byte group, l]
    qh = blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4].reshape(num_blocks, 2, 1, 32)
    scales = blocks[:, QK_K * 3 // 4 : QK_K * 3 // 4 + QK_K // 16].view(np.int8)
    d = blocks[:, -2:].copy().view(np.float16).astype(np.float32)  # [N, 1]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [N, half, 4 quarters, l]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sub_scale = (d * scales.astype(np.float32))[:, :, None]  # [N, 16, 1]
    return (sub_scale * q.reshape(num_blocks, 16, 16).astype(np.float32)).reshape(num_blocks, QK_K)


TYPE_ID_TO_DEQUANTIZER = {Q4_K_TYPE_ID: dequantize_q4_k, Q6_K_TYPE_ID: dequantize_q6_k}


def dequantize(data: np.ndarray, type_id: int) -> np.ndarray:
    """float32 values of one tensor's data as `tensor_data` returns it (numpy shape)."""
    import gguf

    dequantizer = TYPE_ID_TO_DEQUANTIZER.get(type_id)
    if dequantizer is None:
        return np.asarray(gguf.quants.dequantize(data, type_id), dtype=np.float32)
    rows = data.reshape(-1, data.shape[-1])
    block_bytes = TYPE_ID_TO_BLOCK_BYTES[type_id]
    values = dequantizer(rows.reshape(-1, block_bytes))
    return values.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * QK_K)


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


def _gemma3_config(gguf_file: GGUFFile, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 keys of a transformers `Gemma3TextConfig` that the GGUF metadata gives or
    llama.cpp implies (its converter drops what its runtime hard-codes)."""
    num_layers = hf_config["num_hidden_layers"]
    pattern = gguf_file.field("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer, True = sliding
        is_sliding = [bool(value) for value in pattern]
    else:
        period = int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN)
        is_sliding = [(layer + 1) % period != 0 for layer in range(num_layers)]
    if len(is_sliding) != num_layers:
        raise ValueError(
            f"gemma3.attention.sliding_window_pattern has {len(is_sliding)} entries for "
            f"{num_layers} layers"
        )
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer 27B model, whose
    # query_pre_attn_scalar is hidden_size / num_attention_heads.
    query_pre_attn_scalar = (
        hf_config["hidden_size"] // hf_config["num_attention_heads"]
        if num_layers == 62
        else hf_config["head_dim"]
    )
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(_arch_field(gguf_file, "gemma3", "attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if sliding else "full_attention" for sliding in is_sliding
        ],
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "final_logit_softcapping": gguf_file.field("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": gguf_file.field("gemma3.attn_logit_softcapping"),
    }


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
