"""How many CTAs of a kernel one sm_90 SM holds at once (the CUDA occupancy calculator's rules
for compute capability 9.0): pure Python, shared by the launcher (which reads a compiled
kernel's registers on the GPU) and the static resource report (which reads `ptxas -v`)."""

from __future__ import annotations

import math

from core_engine.common.math_utils import round_up

MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers, per warp
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
SHARED_BYTES_PER_SM = 228 * 1024
MAX_SHARED_BYTES_PER_CTA = 227 * 1024
RESERVED_SHARED_BYTES_PER_CTA = 1024
SHARED_ALLOCATION_UNIT = 128
DEFAULT_SHARED_BYTES = 48 * 1024  # per CTA without the opt-in


def ctas_per_sm(registers: int, threads_per_cta: int, shared_bytes: int) -> int:
    """Resident CTAs per sm_90 SM, limited by registers, threads, CTA slots and shared memory."""
    warps = math.ceil(threads_per_cta / 32)
    registers_per_warp = round_up(max(registers, 1) * 32, REGISTER_ALLOCATION_UNIT)
    by_registers = (REGISTERS_PER_SM // registers_per_warp) // warps
    by_threads = MAX_THREADS_PER_SM // (warps * 32)
    shared = round_up(shared_bytes + RESERVED_SHARED_BYTES_PER_CTA, SHARED_ALLOCATION_UNIT)
    by_shared = SHARED_BYTES_PER_SM // shared
    return min(by_registers, by_threads, by_shared, MAX_CTAS_PER_SM)
