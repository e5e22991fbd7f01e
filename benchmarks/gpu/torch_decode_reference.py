"""`TorchDecodeReference`: what a decode step of a model's shape costs in plain torch at its best.

A static batch (every row at the same position), a contiguous KV cache [layers, K/V, batch,
max_len, kv_heads, head_dim], the weights fused as engines fuse them (qkv, gate_up), SDPA over
the cache with a length mask, the LM head and a greedy argmax, all captured in one CUDA graph
and replayed: no paging, no scheduler, no host work per step. The engine's decode step is set
beside it (benchmarks/gpu/decode_check.py). The weights are random, of the shape's sizes; the
forward is Llama's (Qwen3's with per-head q/k RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The sizes of one model (from its config.json fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> DecodeShape:
        hidden = config["hidden_size"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or hidden // config["num_attention_heads"],
            qk_norm=config.get("model_type") == "qwen3",
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
        )


class TorchDecodeReference:
    """One decode step of `batch_size` rows over `max_len` cached positions, as a CUDA graph.

    `step()` replays it for the current `position` (every row attends to keys 0..position and
    writes its new K/V there); `replay_ms(n)` times n replays with CUDA events.
    """

    def __init__(
        self,
        shape: DecodeShape,
        batch_size: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        self.shape, self.batch_size, self.max_len = shape, batch_size, max_len
        generator = torch.Generator(device).manual_seed(seed)

        def weight(*size: int) -> torch.Tensor:
            return (0.02 * torch.randn(size, generator=generator, device=device)).to(dtype)

        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.embed = weight(shape.vocab_size, shape.hidden_size)  # tied with the LM head
        self.layers = [
            {
                "qkv": weight(q_size + 2 * kv_size, shape.hidden_size),
                "o": weight(shape.hidden_size, q_size),
                "gate_up": weight(2 * shape.intermediate_size, shape.hidden_size),
                "down": weight(shape.hidden_size, shape.intermediate_size),
                "norm1": torch.ones(shape.hidden_size, dtype=dtype, device=device),
                "norm2": torch.ones(shape.hidden_size, dtype=dtype, device=device),
                "q_norm": torch.ones(shape.head_dim, dtype=dtype, device=device),
                "k_norm": torch.ones(shape.head_dim, dtype=dtype, device=device),
            }
            for _ in range(shape.num_layers)
        ]
        self.final_norm = torch.ones(shape.hidden_size, dtype=dtype, device=device)
        cache_shape = (
            shape.num_layers, 2, batch_size, shape.num_kv_heads, max_len, shape.head_dim
        )  # fmt: skip
        self.kv_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        inv_freq = shape.rope_theta ** (
            -torch.arange(0, shape.head_dim, 2, device=device, dtype=torch.float32) / shape.head_dim
        )
        self.inv_freq = inv_freq
        self.input_ids = torch.randint(
            3, shape.vocab_size, (batch_size,), generator=generator, device=device
        )
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.key_positions = torch.arange(max_len, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.next_ids: torch.Tensor | None = None

    def capture(self) -> None:
        """Warm up on a side stream, then capture `forward` as one graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.next_ids = self.forward()

    def replay_ms(self, num_steps: int, first_position: int) -> float:
        """Mean milliseconds per replayed step over `num_steps` positions from `first_position`."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():  # next_ids was made under it
            self.position.fill_(first_position)
            self.graph.replay()  # the first replay uploads the graph
            start.record()
            for _ in range(num_steps):
                self.graph.replay()
                self.position.add_(1)
                self.input_ids.copy_(self.next_ids)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / num_steps

    def forward(self) -> torch.Tensor:
        """One decode step at `self.position` for every row; the greedy next ids."""
        shape = self.shape
        x = self.embed[self.input_ids]
        angles = self.position.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        visible = (self.key_positions <= self.position)[None, None, None, :]
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, x, cos, sin, visible)
            h = F.rms_norm(x, (shape.hidden_size,), layer["norm2"], shape.rms_norm_eps)
            gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        x = F.rms_norm(x, (shape.hidden_size,), self.final_norm, shape.rms_norm_eps)
        return (x @ self.embed.T).float().argmax(dim=-1)

    def _attention(self, index, layer, x, cos, sin, visible) -> torch.Tensor:
        shape, batch = self.shape, self.batch_size
        h = F.rms_norm(x, (shape.hidden_size,), layer["norm1"], shape.rms_norm_eps)
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        q, k, v = (h @ layer["qkv"].T).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, shape.num_heads, 1, shape.head_dim)
        k = k.view(batch, shape.num_kv_heads, 1, shape.head_dim)
        v = v.view(batch, shape.num_kv_heads, 1, shape.head_dim)
        if shape.qk_norm:
            q = F.rms_norm(q, (shape.head_dim,), layer["q_norm"], shape.rms_norm_eps)
            k = F.rms_norm(k, (shape.head_dim,), layer["k_norm"], shape.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = self.kv_cache[index, 0], self.kv_cache[index, 1]
        keys.index_copy_(2, self.position, k)
        values.index_copy_(2, self.position, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
        return out.reshape(batch, q_size) @ layer["o"].T


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary of x [B, H, 1, D] by cos/sin [1, D / 2]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
