"""Integer helpers for block and tile counts."""

from __future__ import annotations

import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b: how many blocks of b hold a items."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return cdiv(value, multiple) * multiple


def concatenated_ranges(counts: np.ndarray) -> np.ndarray:
    """int64 0..c-1 for each count c of `counts`, concatenated: [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
