"""Builds the C kernels of the CPU worker with the system compiler, once per machine.

One shared library holds them all: paged attention (`paged_attention.c`, and
`prefill_attention.c` for long queries over a float32 cache on AVX2), the fused
elementwise ops of a decoder layer (`fused_ops.c`), the bf16 matmul of a bf16
model's linears and LM head (`bf16_matmul.c`), the float32 matmul of a float32 model's
on CPUs without AVX-512 (`f32_matmul.c`), the matmul of weights kept as GGUF blocks
(`gguf_matmul.c`), a decoder stack's layers in one call (`decode_layers.c`) and the
batched LoRA shrink+expand of the adapters' tokens (`lora_shrink_expand.c`). It is
compiled with `-march=native`,
so it is cached under a key made of the sources' text, the compile command, the compiler's
version and this CPU's model and flags:
a cache directory shared by different machines never hands one a library built for another.
Builds go to a temporary file renamed into place, so concurrent workers are safe.

Nothing here is required: without a C compiler, with CORE_ENGINE_CPU_KERNELS=0, or after
`set_enabled(False)` (the worker's --enforce-eager) `load` returns None and the engine runs the
torch reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "paged_attention.c",
        "prefill_attention.c",
        "fused_ops.c",
        "bf16_matmul.c",
        "f32_matmul.c",
        "gguf_matmul.c",
        "decode_layers.c",
        "lora_shrink_expand.c",
        "softmax_sample.c",
    )
)
HEADERS = (
    KERNEL_DIR / "scalar_math.h",
    KERNEL_DIR / "attention_args.h",
    KERNEL_DIR / "work_sharing.h",
    KERNEL_DIR / "f32_tiles.h",
    KERNEL_DIR / "gguf_blocks.h",
    KERNEL_DIR / "gguf_bytes.h",
)
LIBRARY_NAME = "cpu_kernels"
# -fno-trapping-math: no kernel unmasks floating-point exceptions, and without it GCC will not
# if-convert the clamps and selects of exp/SiLU on AVX2 (no masked loads), leaving those loops
# scalar; results are bit-identical (it changes no rounding, NaN or infinity semantics).
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)
DISABLE_ENV = "CORE_ENGINE_CPU_KERNELS"
CACHE_ENV = "CORE_ENGINE_KERNEL_CACHE"
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """$CORE_ENGINE_KERNEL_CACHE, else $XDG_CACHE_HOME/core-engine/cpu-kernels (~/.cache)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "core-engine" / "cpu-kernels"


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Whether this process may build and use the C kernels (False: torch ops only)."""
    global _enabled
    _enabled = enabled


def load() -> ctypes.CDLL | None:
    """The compiled kernel library with its argument types set, or None when turned off or
    unavailable (logged once). Called per op, so it reads only a flag and a cache; the
    environment switch is read at the first load (and again after `forget_loaded`)."""
    return _load_once() if _enabled else None


def forget_loaded() -> None:
    """Drops the library `load` returned, so the next call builds or opens it again."""
    _load_once.cache_clear()


@functools.cache
def _load_once() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc/gcc/$CC): the CPU worker runs torch ops only")
        return None
    try:
        return open_library(build(compiler))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, running the torch reference: %s", exc)
        return None


def open_library(path: Path) -> ctypes.CDLL:
    """The built library at `path`, its functions' argument types declared."""
    library = ctypes.CDLL(str(path))
    _declare(library)
    return library


def build(compiler: str, extra_flags: tuple[str, ...] = (), directory: Path | None = None) -> Path:
    """The cached library for these sources, compiler, flags and CPU; compiled if missing.

    `extra_flags` go after COMPILE_FLAGS (tests build the AVX2 and plain-C paths with
    `-mno-avx512f` and `-mno-avx2 -mno-fma`, and every kind of CPU's build with a `-march` of
    its own). The cache is `directory`, else `cache_dir()`. Raises OSError when the compiler
    fails.
    """
    command = [compiler, *COMPILE_FLAGS, *extra_flags]
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    for part in (" ".join(command).encode(), _compiler_version(compiler), _cpu_identity()):
        key.update(part)
    target = (directory or cache_dir()) / f"{LIBRARY_NAME}-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        compile_shared_library(command, SOURCES, target, libraries=("-lm",))
    return target


def compile_shared_library(
    command: Sequence[str], sources: Sequence[Path], target: Path, libraries: Sequence[str] = ()
) -> None:
    """Runs `command -o STAGING sources libraries` and renames the result to `target`, so a
    concurrent reader never sees a half-written library. Raises OSError with the compiler's
    message when it fails; leaves no staging file behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f"{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*command, "-o", staging, *map(str, sources), *libraries],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {result.stderr.strip()[-4000:]}")
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def _compiler_version(compiler: str) -> bytes:
    result = subprocess.run(
        [compiler, "--version"], capture_output=True, timeout=COMPILE_TIMEOUT_S, check=True
    )
    return result.stdout


def _cpu_identity() -> bytes:
    """The CPU's model name and flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)})).encode()


def _declare(library: ctypes.CDLL) -> None:
    pointer, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    _signature(library.paged_attention_vector_floats, [], ctypes.c_int)
    _signature(library.paged_attention_bf16_fast_path, [i32, i32], ctypes.c_int)
    # key, key_stride, value, value_stride, kv_cache, half_bytes, slots, num_tokens, row_bytes
    _signature(
        library.reshape_and_cache, [pointer, i64, pointer, i64, pointer, i64, pointer, i64, i64]
    )
    args = ctypes.c_void_p  # a pointer to AttentionArgs (kernels/cpu/attention_args.py)
    _signature(library.attention_args_layout, [pointer, i32], i64)
    # args, max_rows_x_len
    _signature(library.paged_attention, [args, i64], ctypes.c_int)
    _signature(library.prefill_attention_tile_tokens, [i32, i32], ctypes.c_int)
    _signature(library.prefill_attention, [args], ctypes.c_int)
    # x, residual, weight, out, bf16, rows, cols, eps, num_threads
    _signature(
        library.fused_add_rms_norm, [pointer, pointer, pointer, pointer, i32, i64, i64, f32, i32]
    )
    # x, bf16, tokens, row_stride, num_heads, head_dim, cos, sin, num_threads
    _signature(
        library.rotary_embedding_neox, [pointer, i32, i64, i64, i32, i32, pointer, pointer, i32]
    )
    # x, out, bf16, rows, width, num_threads
    _signature(library.silu_and_mul, [pointer, pointer, i32, i64, i64, i32])
    _signature(library.bf16_matmul_tile_columns, [], ctypes.c_int)
    # x, packed, bias, out, out_bf16, rows, k, padded_columns, num_columns, num_threads
    _signature(
        library.bf16_matmul, [pointer, pointer, pointer, pointer, i32, i64, i64, i64, i64, i32]
    )
    _signature(library.f32_matmul_panel_columns, [], ctypes.c_int)
    # x, x_stride, packed, bias, out, rows, k, num_panels, num_columns, num_threads
    _signature(
        library.f32_matmul, [pointer, i64, pointer, pointer, pointer, i64, i64, i64, i64, i32]
    )
    # x, x_stride, packed, bias, out, rows, k, num_pairs, num_threads
    _signature(
        library.f32_matmul_silu_and_mul,
        [pointer, i64, pointer, pointer, pointer, i64, i64, i64, i32],
    )
    _signature(library.gguf_block_elements, [i32], ctypes.c_int)
    _signature(library.gguf_block_bytes, [i32], ctypes.c_int)
    _signature(library.gguf_matmul_has_panels, [], ctypes.c_int)
    _signature(library.gguf_matmul_integer_bits, [], ctypes.c_int)
    _signature(library.gguf_matmul_integer_max_rows, [], ctypes.c_int)
    _signature(library.gguf_matmul_byte_bits, [], ctypes.c_int)
    # x, x_stride, blocks, type, bias, out, out_stride, rows, k, num_columns, num_threads
    _signature(
        library.gguf_matmul,
        [pointer, i64, pointer, i32, pointer, pointer, i64, i64, i64, i64, i32],
    )
    # stack, step, residual, normed, projected, out
    _signature(library.decode_layers, [pointer] * 6, ctypes.c_int)
    _signature(library.decode_layers_layout, [pointer, i32], i64)
    # blocks, type, k, row_ids, num_rows, out
    _signature(library.gguf_dequantize_rows, [pointer, i32, i64, pointer, i64, pointer])
    _signature(library.lora_shrink_expand_vector_floats, [], ctypes.c_int)
    # x, y, lora_a, lora_b, token_slots, bf16, tokens, in, out, width, slots, num_threads
    _signature(
        library.lora_shrink_expand,
        [pointer, pointer, pointer, pointer, pointer, i32, i64, i64, i64, i64, i64, i32],
        ctypes.c_int,
    )
    # logits, row_stride, num_rows, vocab, temperatures, uniforms, tokens, num_threads
    _signature(
        library.softmax_sample, [pointer, i64, i64, i64, pointer, pointer, pointer, i32], i64
    )


def _signature(function, argtypes: list, restype=None) -> None:
    function.argtypes = argtypes
    function.restype = restype
