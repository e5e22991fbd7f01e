"""`decode_layers.c`'s structs as ctypes twins, and how a linear's kernel weight fills one.

`Linear`, `DecoderLayer`, `DecoderStack` and `DecodeStep` declare the C structs' fields in the
same order; `layout_matches(library)` compares their sizes and a few offsets with what the
compiled library reports (the tests call it). The structs hold addresses only: whoever fills
one keeps the tensors behind it alive for as long as the struct is used.
"""

from __future__ import annotations

import ctypes

from core_engine.kernels.cpu.attention_args import AttentionArgs
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.kernels.cpu.gguf_matmul import GgufMatmulWeight

MAX_SEGMENTS = 4
LINEAR_GGUF = 1
LINEAR_F32 = 2
# The parts decode_layers.c times into DecodeStep.part_seconds, in its order.
PART_NAMES = (
    "linears",
    "attention",
    "norms and rotary",
    "SiLU-and-mul",
    "gate_up + SiLU-and-mul",
    "embedding",
)
EMBEDDING_F32 = -1  # DecoderStack.embedding_type of float32 rows (else a GGUF type id)
# decode_layers' results besides 0 (ERROR_ in decode_layers.c).
ERROR_ATTENTION_SCORES = -1  # attention could not allocate its scores
ERROR_TOKEN_ID = -2  # a token id outside [0, vocab_rows)
ERROR_POSITION = -3  # a position outside [0, angle_rows)


class Linear(ctypes.Structure):
    _fields_ = (
        ("kind", ctypes.c_int32),
        ("num_segments", ctypes.c_int32),
        ("blocks", ctypes.c_void_p * MAX_SEGMENTS),
        ("types", ctypes.c_int32 * MAX_SEGMENTS),
        ("segment_rows", ctypes.c_int64 * MAX_SEGMENTS),
        ("packed", ctypes.c_void_p),
        ("num_panels", ctypes.c_int64),
        ("fuses_silu_and_mul", ctypes.c_int32),
        ("bias", ctypes.c_void_p),
        ("k", ctypes.c_int64),
        ("num_columns", ctypes.c_int64),
        ("lora_a", ctypes.c_void_p),
        ("lora_b", ctypes.c_void_p),
        ("lora_width", ctypes.c_int64),
        ("lora_slots", ctypes.c_int64),
    )


class DecoderLayer(ctypes.Structure):
    _fields_ = (
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("kv_cache", ctypes.c_void_p),
    )


class DecoderStack(ctypes.Structure):
    _fields_ = (
        ("layers", ctypes.c_void_p),
        ("num_layers", ctypes.c_int32),
        ("hidden_size", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate_size", ctypes.c_int32),
        ("rms_norm_eps", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("final_norm", ctypes.c_void_p),
        ("embedding_type", ctypes.c_int32),
        ("embedding_blocks", ctypes.c_void_p),
        ("embedding_rows", ctypes.c_void_p),
        ("vocab_rows", ctypes.c_int64),
    )


class DecodeStep(ctypes.Structure):
    _fields_ = (
        ("num_tokens", ctypes.c_int64),
        ("token_ids", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("angle_cos", ctypes.c_void_p),
        ("angle_sin", ctypes.c_void_p),
        ("angle_rows", ctypes.c_int64),
        ("attention", AttentionArgs),
        ("attention_scratch_floats", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("query", ctypes.c_void_p),
        ("attended", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("activation", ctypes.c_void_p),
        ("num_threads", ctypes.c_int32),
        ("part_seconds", ctypes.c_void_p),
        ("lora_token_slots", ctypes.c_void_p),
    )


def layout_matches(library: ctypes.CDLL) -> bool:
    """Whether these structs have the compiled ones' sizes and checked offsets."""
    reported = (ctypes.c_int64 * 14)()
    count = library.decode_layers_layout(reported, len(reported))
    expected = (
        ctypes.sizeof(Linear),
        ctypes.sizeof(DecoderLayer),
        ctypes.sizeof(DecoderStack),
        ctypes.sizeof(DecodeStep),
        DecodeStep.attention.offset,
        DecodeStep.part_seconds.offset,
        DecoderLayer.kv_cache.offset,
        Linear.bias.offset,
        Linear.lora_slots.offset,
        DecodeStep.lora_token_slots.offset,
        DecoderStack.final_norm.offset,
        DecoderStack.vocab_rows.offset,
        DecodeStep.angle_rows.offset,
        DecodeStep.sin.offset,
    )
    return count == len(expected) and tuple(reported) == expected


def add_lora_slots(linear: Linear, lora_a, lora_b) -> None:
    """Points `linear` at its adapters' slots: float32 contiguous lora_a [slots, width, k] and
    lora_b [slots, num_columns, width], which must outlive the struct."""
    linear.lora_a = lora_a.data_ptr()
    linear.lora_b = lora_b.data_ptr()
    linear.lora_slots, linear.lora_width = lora_a.shape[0], lora_a.shape[1]


def linear_of(weight, bias, fuses_silu_and_mul: bool = False) -> Linear | None:
    """The C struct of a kernel weight (and its float32 contiguous bias, or None), or None
    for a weight decode_layers.c does not take (oneDNN's, bf16's, more segments than it
    holds)."""
    bias_address = None if bias is None else bias.data_ptr()
    if isinstance(weight, F32MatmulWeight):
        return Linear(
            kind=LINEAR_F32,
            packed=weight.packed.data_ptr(),
            num_panels=weight.packed.shape[0],
            fuses_silu_and_mul=int(fuses_silu_and_mul),
            bias=bias_address,
            k=weight.k,
            num_columns=weight.num_columns,
        )
    if isinstance(weight, GgufMatmulWeight) and len(weight.segments) <= MAX_SEGMENTS:
        segments = weight.segments
        linear = Linear(
            kind=LINEAR_GGUF,
            num_segments=len(segments),
            bias=bias_address,
            k=weight.k,
            num_columns=weight.num_columns,
        )
        for i, segment in enumerate(segments):
            linear.blocks[i] = segment.blocks.data_ptr()
            linear.types[i] = segment.type_id
            linear.segment_rows[i] = segment.num_rows
        return linear
    return None
