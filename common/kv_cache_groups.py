"""How a model's layers share KV cache blocks: groups of layers with the same attention window.

As in vLLM's hybrid allocator, the layers of each attention type (full attention, or a sliding
window of W tokens) are cut into groups of `layers_per_group` consecutive layers of that type,
the greatest common divisor of the types' layer counts. Every group then has as many layers, so
a KV block has one size in every group (the K and V of `layers_per_group` layers for
`block_size` tokens) and all groups draw from one pool of blocks. The layer at position i of its
group keeps its KV in the i-th of `layers_per_group` cache tensors. A model with one attention
type has one group of all its layers: a block holds every layer, as before groups existed.

The core (which schedules the groups' blocks) and the workers (which lay out the tensors) both
derive the groups from the model's per-layer windows with `group_layers`, so they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing one block table. `sliding_window` None: full attention."""

    sliding_window: int | None
    layer_indices: tuple[int, ...]


def group_layers(
    layer_sliding_windows: Sequence[int | None], hybrid: bool = True
) -> list[KVCacheGroup]:
    """The KV cache groups of a model whose layer i attends to `layer_sliding_windows[i]`
    tokens (None: all of them). Full-attention groups come first, then windows by size.

    `hybrid=False` (vLLM's `--disable-hybrid-kv-cache-manager`): one full-attention group of
    every layer, whatever the windows; window layers then keep their whole context's KV and only
    their attention masks it."""
    if not layer_sliding_windows:
        raise ValueError("a model needs at least one layer to have KV cache groups")
    if not hybrid:
        return [KVCacheGroup(None, tuple(range(len(layer_sliding_windows))))]
    window_to_layers: dict[int | None, list[int]] = {}
    for layer_index, window in enumerate(layer_sliding_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer_index} has sliding window {window}; it must be >= 1")
        window_to_layers.setdefault(window, []).append(layer_index)
    layers_per_group = math.gcd(*(len(layers) for layers in window_to_layers.values()))
    windows = sorted(window_to_layers, key=lambda w: (w is not None, w or 0))
    return [
        KVCacheGroup(window, tuple(window_to_layers[window][start : start + layers_per_group]))
        for window in windows
        for start in range(0, len(window_to_layers[window]), layers_per_group)
    ]


def layers_per_group(groups: Sequence[KVCacheGroup]) -> int:
    """How many layers' KV one block holds (the same in every group)."""
    return len(groups[0].layer_indices)
