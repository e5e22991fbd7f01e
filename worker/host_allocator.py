"""Keeps glibc's malloc from handing activation memory back to the OS after every op.

By default glibc serves blocks above a (self-adjusting) threshold of 128 KiB to 32 MiB with
their own mmap, unmaps them on free, and trims the heap top above 128 KiB. A forward pass
allocates and frees the same large activations in every layer, so with those defaults each op's
output comes back as fresh pages: a page fault and a zeroed page for every 4 KiB written, which
costs a memory-bound elementwise op far more than its arithmetic.

A worker is one long-lived process whose peak host memory is bounded by the step size, so
keeping freed memory for reuse is the right trade; blocks above 32 MiB are still mapped and
unmapped one by one, and at most 256 MiB of free heap is kept. Only the worker calls this: it
changes the whole process's allocator, which is no library's business in a user's own process.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap; it is glibc's ceiling on 64-bit (larger values
# are refused), and setting it also stops the threshold from adjusting itself.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the heap top is returned to the OS only beyond this: the most a worker keeps
# that it may not need again (e.g. after loading weights), and far above one step's activations
# below the mmap threshold.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Sets the two thresholds; False (and nothing changes) where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if not applied:
        logger.warning("mallopt refused the allocator thresholds; host memory is per-op")
    return applied
