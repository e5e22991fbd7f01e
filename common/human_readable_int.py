"""vLLM's human-readable integers for token counts on the command line: `16k` is 16,000, `16K`
is 16,384 (decimal suffixes k, m, g, t; binary K, M, G, T; decimals with decimal suffixes only)."""

from __future__ import annotations

import re

DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def parse_human_readable_int(text: str) -> int:
    """The integer `text` spells (`4096`, `16k`, `1.5m`, `32K`); ValueError naming it otherwise."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"expected an integer such as 4096, 16k (16,000) or 16K (16,384), got {text!r}"
        )
    number, suffix = match.groups()
    if suffix in DECIMAL_SUFFIXES:
        return int(float(number) * DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise ValueError(
            f"{text!r}: a fraction needs a decimal suffix (k, m, g, t), as in "
            f"{number}{suffix.lower() or 'k'}"
        )
    return int(number) * BINARY_SUFFIXES.get(suffix, 1)
