"""The one table of compute dtypes the engine accepts, by name.

Configs and messages carry names (`EngineConfig.dtype`); workers and kernels turn them into torch
dtypes here, so no second table can disagree with this one. torch is imported only by the
functions that need it, so `core/` and `proto/` can read the names without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")


def check_dtype_name(name: str) -> str:
    """`name` if it is one of DTYPE_NAMES, else ValueError naming the choices."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (one of DTYPE_NAMES)."""
    import torch

    return getattr(torch, check_dtype_name(name))


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a supported torch dtype; ValueError for any other (float64, int8, ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPE_NAMES)}")
    return name
