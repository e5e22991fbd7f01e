"""Building blocks of the Llama family: RMSNorm, RoPE, SiLU-and-mul, tensor-parallel linears.

Tensor parallelism (Megatron style): column-parallel layers split their output features over
ranks, row-parallel layers split their input features and all-reduce the partial sums, the
embedding and LM head split the vocabulary. Every parameter carries a `weight_loader` that
takes the FULL checkpoint tensor and copies in this rank's slice, so loaders never know about
ranks. With `tp_size == 1` the collectives are no-ops; with more they use the default
torch.distributed process group that `worker.parallel_state.init_distributed` joined.

Numerics follow transformers' Llama (norm in float32, RoPE angles in float32, same operation
order), so logits match it to float32 rounding. On a CPU with the C kernels built, the residual
add + norm, RoPE and SiLU-and-mul run fused (`kernels.cpu.fused_ops`): float32 inside, one
rounding of a bf16 result, so they differ from the torch ops by a few float32 ulps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core_engine.common.config_error import ConfigError
from core_engine.common.math_utils import cdiv
from core_engine.kernels.cpu import fused_ops as cpu_fused_ops
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.kernels.cpu.gguf_matmul import GgufMatmulWeight
from core_engine.worker.model_executor.cpu_linear import PackableLinear, gguf_weight_of
from core_engine.worker.model_executor.gguf_tensor import GgufTensor
from core_engine.worker.parallel_state import tensor_parallel_all_gather, tensor_parallel_all_reduce


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator ranks, or ConfigError naming tensor_parallel_size and the
    model's `what` when it does not split evenly."""
    if numerator % denominator != 0:
        divisors = [d for d in range(1, numerator + 1) if numerator % d == 0]
        raise ConfigError(
            f"tensor_parallel_size={denominator} does not divide the model's {what}={numerator}; "
            f"choose one of {', '.join(map(str, divisors))}"
        )
    return numerator // denominator


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copies a replicated weight; the shapes must match exactly."""
    check_shape(loaded_weight, tuple(param.shape))
    param.data.copy_(loaded_weight)


def load_rows(param: nn.Parameter, offset: int, loaded: torch.Tensor | GgufTensor) -> None:
    """Rows [offset, offset + len(loaded)) of `param` from `loaded`: copied, or, for GGUF blocks
    (`--quantization gguf`), kept as the parameter's segment at `offset`, the dense rows never
    written (so never resident)."""
    if isinstance(loaded, GgufTensor):
        param.gguf_segments[offset] = loaded.segment()
        return
    default_weight_loader(param.data.narrow(0, offset, loaded.shape[0]), loaded)


def check_shape(loaded_weight: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    """ValueError naming both shapes unless the FULL checkpoint tensor has `expected_shape`."""
    if tuple(loaded_weight.shape) != tuple(expected_shape):
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit a parameter "
            f"of full shape {tuple(expected_shape)}"
        )


def _new_parameter(*shape: int, weight_loader) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten from the checkpoint (the loader checks), or
    # left unwritten when its checkpoint tensor comes as GGUF blocks (`load_rows`).
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    param.gguf_segments = {}  # first row -> GgufSegment, when loaded as GGUF blocks
    return param


def residual_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual stream between decoder layers.

    float32 on CPU whatever the weights' dtype: with bf16 weights only the matmul inputs are
    rounded to bf16, and the sums of the residual stream stay exact enough for bf16 greedy
    output to match float32's (tests/worker/test_bf16_accuracy.py requires at least 90% of its prompts
    to match; a bf16 stream does not get there). It costs two [T, hidden] conversions per layer.
    On CUDA the stream stays in the model's dtype, as in transformers and vLLM.
    """
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim, normalized in float32.

    `forward(x)` -> y; `forward(x, residual)` -> (y, residual + x): the pre-norm block's residual
    add fused with the norm of its result (vLLM's fused_add_rms_norm). y comes out in the
    weight's dtype; the residual keeps its own. When x has the weight's dtype the numerics are
    transformers' (normalize in float32, round to the dtype, multiply by the weight); a float32
    residual stream under low-precision weights is scaled in float32 and rounded once. On a CPU
    with the C kernels, the fused form updates `residual` in place and returns it.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_parameter(hidden_size, weight_loader=default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._normalize(x)
        if self._fuses(x, residual):
            out = cpu_fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out, residual
        residual = residual + x
        return self._normalize(residual), residual

    def _fuses(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the C kernel takes this add + norm: [T, H] rows, a contiguous float32
        residual and x in the weight's dtype, on a CPU with the kernels built."""
        return (
            x.dim() == 2
            and residual.dtype == torch.float32
            and residual.is_contiguous()
            and x.dtype == self.weight.dtype
            and cpu_fused_ops.supports(x, residual, self.weight)
        )

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.weight.dtype
        x32 = x.float()
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if x.dtype == out_dtype:
            return self.weight * normalized.to(out_dtype)
        return (self.weight.float() * normalized).to(out_dtype)


class GemmaRMSNorm(nn.Module):
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), in float32, out in the weight's dtype.

    Gemma's norm: the checkpoint stores weight - 1 (transformers' Gemma3RMSNorm, whose float32
    numerics this repeats op for op). No fused residual add: Gemma adds the residual after a
    second norm of each sub-block's output.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_parameter(hidden_size, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalized * (1.0 + self.weight.float())).to(self.weight.dtype)


# Rows the rotary angle table starts with (it doubles from there as positions need).
MIN_ANGLE_TABLE_ROWS = 4096


class RotaryEmbedding(nn.Module):
    """RoPE angles for rotate-half (NEOX/HF) layout: `forward(positions)` -> float32 (cos, sin)
    [T, D / 2], the angles of the pairs (i, i + D / 2).

    `rope_scaling` None, {"rope_type": "linear", "factor"} or Llama 3's
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}, or {"rope_type": "gguf_freq_factors", "freq_factors"}
    (llama.cpp's per-frequency divisors, one per rotary pair). Any position works: on a GPU
    the angles are computed on the fly (a captured graph replays them); on a CPU they are rows of
    `angle_table`, which grows to the largest position asked for, so the Python layers and the C
    decode driver (cpu_decoder.py) read the same bits.
    """

    _angle_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            rope_theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
        )
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "gguf_freq_factors":
            freq_factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
            if freq_factors.shape != inv_freq.shape:
                raise ValueError(
                    f"rope freq_factors has {freq_factors.numel()} values, expected head_dim / 2 "
                    f"= {inv_freq.numel()}"
                )
            inv_freq = inv_freq / freq_factors
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.is_cpu and positions.numel():
            cos, sin = self.angle_table(int(positions.max()) + 1)
            return cos[positions], sin[positions]
        return self._angles(positions)

    def angle_table(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (cos, sin) [P, D / 2] of positions 0 .. P - 1, P >= num_positions (CPU):
        kept, and regrown to twice the size (at least) when a later call needs more rows."""
        table = self._angle_table
        if table is None or table[0].shape[0] < num_positions:
            held = 0 if table is None else table[0].shape[0]
            size = max(num_positions, 2 * held, MIN_ANGLE_TABLE_ROWS)
            table = self._angles(torch.arange(size, device=self.inv_freq.device))
            self._angle_table = table
        return table

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (transformers' `_compute_llama3_parameters`)."""
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by float32 (cos, sin) [T, D / 2]. The torch ops compute in x's dtype
    and give transformers' bits (x * cos + rotate_half(x) * sin, term by term); on a CPU with
    the C kernels x is rotated IN PLACE and returned (callers pass temporaries)."""
    if x.stride(-1) == 1 and x.stride(1) == x.shape[2] and cpu_fused_ops.supports(x):
        cpu_fused_ops.rotary_embedding_neox_(x, cos, sin)
        return x
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` of q [T, H_q, D] and k [T, H_kv, D]; when k's heads directly follow q's
    in each row (views of one fused qkv projection) and the C kernel runs, one in-place call
    rotates both."""
    num_tokens, num_q_heads, head_dim = q.shape
    if (
        k.data_ptr() == q.data_ptr() + num_q_heads * head_dim * q.element_size()
        and k.dtype == q.dtype
        and k.stride() == q.stride()
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and cpu_fused_ops.supports(q)
    ):
        both = q.as_strided((num_tokens, num_q_heads + k.shape[1], head_dim), q.stride())
        cpu_fused_ops.rotary_embedding_neox_(both, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> silu(first half) * second half, [..., I] (gate, then up)."""
    if x.dim() == 2 and cpu_fused_ops.supports(x):
        return cpu_fused_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """`silu_and_mul` as a module (a model's `act_fn`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2 * I] -> gelu_tanh(first half) * second half, [..., I]: Gemma's GeGLU
    (transformers' "gelu_pytorch_tanh")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# A model config's `hidden_act` -> the gated MLP activation that computes it.
ACTIVATION_AND_MUL: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W's output rows split over ranks: rank r holds rows [r*n, (r+1)*n)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, tp_size, "output_size")
        self.weight = _new_parameter(
            self.output_size_per_rank, input_size, weight_loader=self.weight_loader
        )
        self.bias = (
            _new_parameter(self.output_size_per_rank, weight_loader=self.weight_loader)
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        check_shape(loaded_weight, (size * self.tp_size, *param.shape[1:]))
        load_rows(param, 0, loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.matmul(x, self.bias))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate + up).

    Shard i of the checkpoint (`output_sizes[i]` rows) lands in rows
    [sum(output_sizes[:i]) / tp, ...) of this rank's weight.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int
    ) -> None:
        size = divide(self.output_sizes[shard_id], self.tp_size, "output_size")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]))
        load_rows(param, offset, loaded_weight.narrow(0, self.tp_rank * size, size))

    @property
    def fuses_silu_and_mul(self) -> bool:
        """Whether `silu_and_mul` runs inside the matmul: a gate_up pair of equal halves on the
        float32 kernel (kernels/cpu/f32_matmul.py), split on one of its panel boundaries."""
        weight = self.kernel_weight
        return (
            isinstance(weight, F32MatmulWeight)
            and len(self.output_sizes) == 2
            and self.output_sizes[0] == self.output_sizes[1]
            and weight.splits_into_gate_and_up
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), [..., output_size_per_rank / 2]: one kernel pass where
        `fuses_silu_and_mul`, else this matmul then `SiluAndMul` (same result either way)."""
        if self.fuses_silu_and_mul and not self.runs_lora:
            return self.kernel_weight.matmul_silu_and_mul(x, self.bias)
        return silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; rows are [q heads | k heads | v heads] of this rank.

    Query heads split evenly over ranks. KV heads split too, or, when there are fewer KV heads
    than ranks, each rank holds the one KV head its query heads read (replicated).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            if tp_size % num_kv_heads != 0:
                raise ConfigError(
                    f"tensor_parallel_size={tp_size} exceeds the model's num_key_value_heads="
                    f"{num_kv_heads} and is not a multiple of it, so KV heads cannot be "
                    "replicated evenly"
                )
            self.num_kv_heads = 1
            self.kv_head_offset = tp_rank * num_kv_heads // tp_size
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_offset = tp_rank * self.num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, self.kv_head_offset * self.head_dim
        elif shard_id == "v":
            offset = self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_head_offset * self.head_dim
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(loaded_weight, (total_heads * self.head_dim, *param.shape[1:]))
        load_rows(param, offset, loaded_weight.narrow(0, start, size))


class RowParallelLinear(PackableLinear):
    """y = sum over ranks of x_r W_r^T (+ b once): W's input columns split over ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, tp_size, "input_size")
        self.weight = _new_parameter(
            output_size, self.input_size_per_rank, weight_loader=self.weight_loader
        )
        self.bias = (
            _new_parameter(output_size, weight_loader=default_weight_loader) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[1]
        check_shape(loaded_weight, (param.shape[0], size * self.tp_size))
        load_rows(param, 0, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return tensor_parallel_all_reduce(self.add_lora(x, self.matmul(x, bias)), self.tp_size)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks in contiguous ranges.

    Each rank holds ceil(vocab / tp) rows (the last rank's tail rows are zero padding); a token
    outside a rank's range embeds to zero there, and the all-reduce sums the one real row.
    Loaded as GGUF blocks (`gguf_weight`), rows are dequantized as they are looked up.
    """

    gguf_weight: GgufMatmulWeight | None = None

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings_per_rank = cdiv(num_embeddings, tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_rank
        self.weight = _new_parameter(
            self.num_embeddings_per_rank, embedding_dim, weight_loader=self.weight_loader
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint embedding has {loaded_weight.shape[0]} rows, the model config "
                f"says vocab_size={self.num_embeddings}"
            )
        num_rows = max(0, min(self.num_embeddings - self.vocab_start, param.shape[0]))
        if not isinstance(loaded_weight, GgufTensor):
            param.data.zero_()
        load_rows(param, 0, loaded_weight.narrow(0, self.vocab_start, num_rows))

    def finish_loading(self) -> None:
        """Takes the weight's GGUF blocks, if it was loaded as such, for `forward`; the dense
        rows were never written."""
        if self.weight.gguf_segments and self.gguf_weight is None:
            self.gguf_weight = gguf_weight_of(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._embed(input_ids)
        local_ids = input_ids - self.vocab_start
        num_rows = (
            self.gguf_weight.num_columns
            if self.gguf_weight is not None
            else self.num_embeddings_per_rank
        )
        is_local = (local_ids >= 0) & (local_ids < num_rows)
        embeddings = self._embed(local_ids.clamp(0, num_rows - 1))
        embeddings = embeddings * is_local[:, None].to(embeddings.dtype)
        return tensor_parallel_all_reduce(embeddings, self.tp_size)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_weight is not None:
            return self.gguf_weight.dequantize_rows(ids).to(self.weight.dtype)
        return F.embedding(ids, self.weight)


# Vocabulary rows per matmul of the LM head on CPU. One [N, hidden] x [vocab, hidden]^T product
# streams the whole weight (113 MB for SmolLM2) once per block of N; a slice this size stays in
# L2 while every row of x uses it, so each weight row is read from memory once per call instead
# of once per block of N rows.
CPU_LOGITS_ROWS_PER_MATMUL = 256


def _linear_in_row_slices(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """F.linear(x, weight) computed `rows` output features at a time."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for first in range(0, weight.shape[0], rows):
        torch.mm(x, weight[first : first + rows].t(), out=out[:, first : first + rows])
    return out


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Output projection to vocabulary logits, split over ranks like the embedding.

    Packed for a CPU, it computes float32 logits whatever the model's dtype: bf16 logits are
    rounded to steps of 1/16 to 1/8 at typical magnitudes, enough to flip greedy choices
    (tests/worker/test_bf16_accuracy.py checks greedy agreement with float32).
    A bf16 weight on a CPU with AVX512_BF16 runs on `kernels.cpu.bf16_matmul` with float32
    output (the float32 logits of the bf16 operands, at bf16 speed); any other is packed for
    oneDNN in float32.
    """

    packed_dtype = torch.float32

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size] (gathered on every rank)."""
        if self.is_packed:
            logits = self.matmul(hidden_states, None)
            if logits.shape[1] < self.num_embeddings_per_rank:  # GGUF blocks of real rows only
                logits = F.pad(logits, (0, self.num_embeddings_per_rank - logits.shape[1]))
        elif hidden_states.device.type == "cpu":
            logits = _linear_in_row_slices(hidden_states, self.weight, CPU_LOGITS_ROWS_PER_MATMUL)
        else:
            logits = F.linear(hidden_states, self.weight)
        logits = tensor_parallel_all_gather(logits, self.tp_size)
        return logits[:, : self.num_embeddings].float()
