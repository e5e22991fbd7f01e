"""`KVBlockLayout`: what one offloaded KV block's bytes are, so that they are never read back into
a cache of another model, dtype, block size or shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class KVBlockLayout:
    """One block of one rank: `num_layers` x (K, V) x `block_size` tokens x `num_kv_heads` x
    `head_dim` values of `dtype`, laid out [layer, K/V, token, head, dim] (C order).

    `model` names the weights (their resolved path and architecture): KV computed by other
    weights is wrong for these even when every shape agrees. `tp_rank` of `tp_size` says which
    shard of the heads this is.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_elements(self) -> int:
        layers, kv, tokens, heads, dim = self.shape
        return layers * kv * tokens * heads * dim

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming this layout (the disk tier's folder for it)."""
        return xxhash.xxh3_64_hexdigest(self.to_json().encode())
