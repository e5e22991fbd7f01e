"""`Gemma3ForCausalLM`: Gemma 3's text model (transformers' `Gemma3ForCausalLM`).

What sets it apart from the Llama family: a GeGLU MLP (tanh-approximated gelu), RMSNorms that
multiply by (1 + weight), q/k norms, four norms per layer (the attention and MLP outputs are
normed again before their residual adds), embeddings scaled by sqrt(hidden_size) in the model's
dtype, queries scaled by query_pre_attn_scalar ** -0.5, optional final logit soft-capping, and
two kinds of layers: sliding-window layers (attend to the last `sliding_window` positions, RoPE
base `rope_local_theta`) and global layers (full attention, `rope_theta` and `rope_scaling`).

Attention and MLP are `worker.model_executor.models.llama`'s, given Gemma's q/k norm class, query scale,
activation and, on sliding layers, the window (`kernels.write_kv_and_attend(...,
sliding_window=)` skips keys before it; with KV cache groups, the blocks before the window are
freed). Parameter names follow transformers, with q/k/v and gate/up fused as in Llama.
"""

from __future__ import annotations

import torch
from torch import nn

from core_engine.kernels import AttentionMetadata
from core_engine.worker.model_executor.layers import (
    GemmaRMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    residual_dtype,
)
from core_engine.worker.model_executor.model_config import SLIDING_ATTENTION, ModelConfig
from core_engine.worker.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)


class Gemma3DecoderLayer(nn.Module):
    """x + post_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, config: ModelConfig, layer: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        is_sliding = config.layer_types[layer] == SLIDING_ATTENTION
        self.self_attn = LlamaAttention(
            config,
            tp_rank,
            tp_size,
            sliding_window=config.sliding_window if is_sliding else None,
            qk_norm_class=GemmaRMSNorm,
        )
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)  # GeGLU: config.hidden_act
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        residual: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The residual stream before this layer -> the stream after it (same dtype)."""
        hidden_states = self.self_attn(self.input_layernorm(residual), cos_sin, kv_cache, metadata)
        residual = residual + self.post_attention_layernorm(hidden_states).to(residual.dtype)
        hidden_states = self.mlp(self.pre_feedforward_layernorm(residual))
        return residual + self.post_feedforward_layernorm(hidden_states).to(residual.dtype)


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers, final norm: token ids -> last hidden states."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        if config.layer_types is None or config.query_pre_attn_scalar is None:
            raise ValueError("a Gemma 3 model config needs layer_types and query_pre_attn_scalar")
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        # transformers keeps sqrt(hidden_size) as a float32 buffer and casts it to the weights'
        # dtype before multiplying; so does this.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, layer, tp_rank, tp_size)
            for layer in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, config.rope_local_theta, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        """`metadata`: one for every layer, or one per layer (its KV cache group's)."""
        if not isinstance(metadata, list):
            metadata = [metadata] * len(self.layers)
        embeddings = self.embed_tokens(input_ids)
        embeddings = embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype)
        residual = embeddings.to(residual_dtype(embeddings.device, embeddings.dtype))
        cos_sin_global = self.rotary_emb(positions)
        cos_sin_local = self.rotary_emb_local(positions)
        for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata, strict=True):
            is_sliding = layer.self_attn.sliding_window is not None
            cos_sin = cos_sin_local if is_sliding else cos_sin_global
            residual = layer(residual, cos_sin, kv_cache, layer_metadata)
        return self.norm(residual)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The causal LM: `forward` -> hidden states [T, hidden], `compute_logits` -> [N, vocab].

    `LlamaForCausalLM` over a `Gemma3Model` (kv_caches[i] is layer i's full paged cache; metadata
    may be one per layer, its KV cache group's), with Gemma's logit soft-capping.
    """

    model_class = Gemma3Model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size], soft-capped when configured."""
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
