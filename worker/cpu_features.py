"""What the host CPU computes natively, read from the kernel's `/proc/cpuinfo` flags.

The worker's default dtype on a CPU follows it: bfloat16 pays only where the CPU has bf16
dot-product instructions (AVX512_BF16 or AMX); elsewhere torch emulates bf16 matmuls by
converting to fp32 on the fly, several times slower than fp32 itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

CPUINFO_PATH = Path("/proc/cpuinfo")
# Any one of these flags means bf16 matmuls run on native instructions.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The flags of the first processor listed in a /proc/cpuinfo text (x86 "flags",
    ARM "Features"); empty when there is none."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; empty where /proc/cpuinfo cannot be read."""
    try:
        return parse_cpu_flags(CPUINFO_PATH.read_text())
    except OSError:
        return frozenset()


SIMD_LEVELS = (  # widest first: (flag, name)
    ("amx_bf16", "AMX-BF16"),
    ("avx512_bf16", "AVX512_BF16"),
    ("avx512f", "AVX-512 without bf16"),
    ("avx2", "AVX2"),
    ("asimd", "NEON"),
)


def simd_level(flags: frozenset[str]) -> str:
    """The widest vector/matrix extension among `flags`, for logs and benchmark records."""
    for flag, name in SIMD_LEVELS:
        if flag in flags:
            return name
    return "no AVX2/AVX-512/NEON"


def has_native_bf16(flags: frozenset[str]) -> bool:
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


def default_cpu_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 on a CPU with native bf16 instructions, float32 elsewhere."""
    flags = host_cpu_flags() if flags is None else flags
    return torch.bfloat16 if has_native_bf16(flags) else torch.float32
