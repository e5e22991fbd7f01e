"""`LlamaForCausalLM`: one definition for Llama, SmolLM, Mistral, Qwen2 and Qwen3.

The variants differ only in flags of `ModelConfig`: q/k/v bias (Qwen2), per-head q/k RMSNorm
before RoPE (Qwen3), tied or untied embeddings, RoPE scaling. Attention runs over the paged KV
cache through `kernels.write_kv_and_attend`, so one forward serves any mix of prefills, chunked
prefills and decodes packed as a varlen batch.

Parameter names follow transformers (`model.layers.0.self_attn.o_proj.weight`, ...), except
that q/k/v and gate/up are fused; `packed_modules_mapping` tells the loader where each
checkpoint tensor goes.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from core_engine.kernels import AttentionMetadata, write_kv_and_attend
from core_engine.worker.model_executor.cpu_decoder import CpuDecoderStack
from core_engine.worker.model_executor.layers import (
    ACTIVATION_AND_MUL,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    apply_rotary_qk,
    residual_dtype,
)
from core_engine.worker.model_executor.model_config import ModelConfig


class LlamaAttention(nn.Module):
    """GQA self-attention of one layer; holds this rank's heads only. Gemma 3 uses it too, with
    its own q/k norm class and, on its sliding layers, a window (keys before it are skipped)."""

    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int,
        tp_size: int,
        sliding_window: int | None = None,
        qk_norm_class: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.attention_output_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        if config.qk_norm:
            self.q_norm = qk_norm_class(config.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm_class(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.head_dim = config.head_dim
        # Gemma scales queries by query_pre_attn_scalar ** -0.5, the others by head_dim's.
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        proj = self.qkv_proj
        q, k, v = self.qkv_proj(hidden_states).split_with_sizes(
            [proj.q_size, proj.kv_size, proj.kv_size], dim=-1
        )
        q = q.reshape(num_tokens, proj.num_heads, self.head_dim)
        k = k.reshape(num_tokens, proj.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, proj.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_qk(q, k, *cos_sin)
        attn = write_kv_and_attend(q, k, v, kv_cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(attn.reshape(num_tokens, proj.q_size))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one column-parallel matmul; act is
    silu, or Gemma's tanh-approximated gelu (`config.hidden_act`)."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = ACTIVATION_AND_MUL[config.hidden_act]()
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.act_fn, SiluAndMul):
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), with each residual add fused
    into the norm that follows it (the next layer's input norm adds this layer's MLP output)."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's output, residual stream before it) -> the same pair for this
        layer; residual None on the first layer, whose hidden_states are the embeddings."""
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def input_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm: (normalized, residual stream), the stream starting as the
        embeddings on the first layer (residual None) and adding hidden_states after it."""
        if residual is None:
            stream_dtype = residual_dtype(hidden_states.device, hidden_states.dtype)
            if hidden_states.dtype == stream_dtype == torch.float32 and hidden_states.is_cpu:
                # The fused add + norm onto a zero stream: the stream becomes the embeddings
                # exactly, and the norm is the C kernel's, as on every later layer.
                return self.input_layernorm(hidden_states, torch.zeros_like(hidden_states))
            residual = hidden_states.to(stream_dtype)
            return self.input_layernorm(residual), residual
        return self.input_layernorm(hidden_states, residual)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> last hidden states.

    `cpu_decoder` (set by the CPU worker once the linears are packed, see
    `enable_cpu_decoder`) runs the steps it takes from the token ids to the final norm in one
    C call, with the same result as the embedding and the loop over the layers."""

    cpu_decoder: CpuDecoderStack | None = None

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.cpu_decoder is not None:
            hidden_states = self.cpu_decoder.run(input_ids, positions, kv_caches, metadata)
            if hidden_states is not None:
                return hidden_states
        hidden_states, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(hidden_states, residual, cos_sin, kv_cache, metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def enable_cpu_decoder(self) -> bool:
        """Describes the layers to the C decode driver when it runs all of them (a CPU model
        with packed linears); whether it does."""
        self.cpu_decoder = CpuDecoderStack.of(self)
        return self.cpu_decoder is not None


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward` -> hidden states [T, hidden], `compute_logits` -> [N, vocab].

    `kv_caches[i]` is layer i's cache [2, num_blocks, block_size, num_kv_heads_per_rank,
    head_dim]; `forward` writes the new tokens' K/V into it at `metadata.slot_mapping`.
    Subclasses for other decoder stacks set `model_class` (it takes what `forward` passes on:
    one metadata, or one per layer for a model with KV cache groups).
    """

    model_class: type[nn.Module] = LlamaModel

    # checkpoint module name -> (fused module name, shard id for its weight_loader)
    packed_modules_mapping = MappingProxyType(
        {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
    )

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> hidden states [T, hidden] (model dtype)."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size]."""
        return self.lm_head.compute_logits(hidden_states)
