"""Integer helpers for block and tile counts."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b: how many blocks of b hold a items."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return cdiv(value, multiple) * multiple
