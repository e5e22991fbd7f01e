"""`build_kv_block_map`: the state of every block of a `BlockPool`, one byte per cell."""

from __future__ import annotations

import numpy as np

from core_engine.core.kv_cache.block_pool import BlockPool
from core_engine.proto import KVBlockMap, KVBlockState


def build_kv_block_map(pool: BlockPool, max_cells: int) -> KVBlockMap:
    """The pool's blocks as `KVBlockState`s, summarised into at most `max_cells` cells (each the
    busiest state of the blocks it covers). Reads the pool only; O(num_gpu_blocks)."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be at least 1, got {max_cells}")
    states = block_states(pool)
    num_blocks = len(states)
    blocks_per_cell = -(-num_blocks // max_cells)
    num_cells = -(-num_blocks // blocks_per_cell)
    padded = np.zeros(num_cells * blocks_per_cell, dtype=np.uint8)  # FREE pads the last cell
    padded[:num_blocks] = states
    cells = padded.reshape(num_cells, blocks_per_cell).max(axis=1)
    counts = np.bincount(states, minlength=len(KVBlockState))
    return KVBlockMap(
        num_blocks=num_blocks,
        blocks_per_cell=blocks_per_cell,
        states=cells.tobytes(),
        num_blocks_by_state=[int(count) for count in counts],
    )


def block_states(pool: BlockPool) -> np.ndarray:
    """One `KVBlockState` (uint8) per block id: a free block is CACHED while it keeps a hash, a
    held one IN_USE with one reference and SHARED with more; the null block is RESERVED."""
    ref_cnts = np.array([block.ref_cnt for block in pool.blocks], dtype=np.int64)
    has_hash = np.zeros(len(pool.blocks), dtype=np.bool_)
    cached_ids = [
        block_id for _, blocks in pool.cached_block_hash_to_block.items() for block_id in blocks
    ]
    has_hash[cached_ids] = True
    states = np.where(
        ref_cnts == 0,
        np.where(has_hash, KVBlockState.CACHED, KVBlockState.FREE),
        np.where(ref_cnts == 1, KVBlockState.IN_USE, KVBlockState.SHARED),
    ).astype(np.uint8)
    states[pool.null_block.block_id] = KVBlockState.RESERVED
    return states
