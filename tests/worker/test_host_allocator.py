"""The worker's malloc thresholds: freed activations stay in the process for the next op."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc's"
)

# Allocates and frees a 24 MiB block (above glibc's default mmap threshold), touching every
# page, and prints how many of its pages the process still holds afterwards.
PROBE = textwrap.dedent(
    """
    import ctypes, os, sys
    from core_engine.worker.host_allocator import keep_freed_memory
    if sys.argv[1] == "tuned":
        assert keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    def resident_pages():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])
    size = 24 * 1024 * 1024
    before = resident_pages()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    print((resident_pages() - before) * page // (1024 * 1024))
    """
)


def retained_mib(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(result.stdout)


def test_freed_blocks_stay_resident_only_when_tuned():
    assert retained_mib("default") < 4, "glibc's default unmaps a 24 MiB block on free"
    assert retained_mib("tuned") >= 20, "tuned, the block stays in the heap for reuse"
