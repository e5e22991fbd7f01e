"""A tiny random attention model for worker tests, with a dense cache-free reference."""

import math

import torch

from core_engine.kernels import AttentionMetadata, write_kv_and_attend

VOCAB = 48
MAX_MODEL_LEN = 64


class TinyCausalLM:
    """Token + position embeddings, `num_layers` GQA attention layers with residuals, lm head."""

    def __init__(
        self,
        seed: int = 0,
        hidden: int = 32,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        num_layers: int = 2,
    ) -> None:
        g = torch.Generator().manual_seed(seed)

        def weight(*shape):
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_layers = num_layers
        self.embed = torch.randn(VOCAB, hidden, generator=g)
        self.pos_embed = torch.randn(MAX_MODEL_LEN, hidden, generator=g) * 0.5
        self.layers = [
            (
                weight(hidden, num_heads * head_dim),
                weight(hidden, num_kv_heads * head_dim),
                weight(hidden, num_kv_heads * head_dim),
                weight(num_heads * head_dim, hidden),
            )
            for _ in range(num_layers)
        ]
        self.lm_head = weight(hidden, VOCAB) * 4
        self.scale = head_dim**-0.5

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata):
        x = self.embed[input_ids] + self.pos_embed[positions]
        for (wq, wk, wv, wo), kv_cache in zip(self.layers, kv_caches, strict=True):
            q = (x @ wq).view(-1, self.num_heads, self.head_dim)
            k = (x @ wk).view(-1, self.num_kv_heads, self.head_dim)
            v = (x @ wv).view(-1, self.num_kv_heads, self.head_dim)
            attn = write_kv_and_attend(q, k, v, kv_cache, metadata, self.scale)
            x = x + attn.reshape(len(x), -1) @ wo
        return x

    def compute_logits(self, hidden_states):
        return (hidden_states @ self.lm_head).float()

    def dense_next_token_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits after the last token, computed without any cache."""
        n = len(token_ids)
        x = self.embed[torch.tensor(token_ids)] + self.pos_embed[:n]
        group = self.num_heads // self.num_kv_heads
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for wq, wk, wv, wo in self.layers:
            q = (x @ wq).view(n, self.num_heads, self.head_dim).transpose(0, 1)
            k = (x @ wk).view(n, self.num_kv_heads, self.head_dim).repeat_interleave(group, 1)
            v = (x @ wv).view(n, self.num_kv_heads, self.head_dim).repeat_interleave(group, 1)
            scores = (q @ k.permute(1, 2, 0)) * self.scale
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            x = x + (probs @ v.transpose(0, 1)).transpose(0, 1).reshape(n, -1) @ wo
        return self.compute_logits(x[-1])

    def dense_greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        token_ids = list(prompt)
        for _ in range(num_tokens):
            token_ids.append(int(self.dense_next_token_logits(token_ids).argmax()))
        return token_ids[len(prompt) :]
