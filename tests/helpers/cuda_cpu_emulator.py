"""Run the real `kernels/cuda/*.cu` sources on the CPU, for tests on machines without a GPU.

`EmulatedLoader` is a drop-in for `kernels.cuda.module_loader.ModuleLoader`: `get_kernel` compiles
one kernel instance as host C++ (g++) against `cuda_cpu_emulator.h` and returns an
`EmulatedKernel`, callable like a `cupy.RawKernel` with `(grid, block, args, shared_mem=...)`.
Pointer arguments are host addresses, so the tensors are CPU tensors. Every call checks the
argument packing the way the GPU would need it: each argument must be a NumPy scalar whose size
equals the kernel parameter's size (a Python int or float, or an int64 where the kernel takes an
int, is an error), the grid must be non-empty, and the shared memory must fit (above 48 KB
only when `get_kernel` was given at least that size, as CuPy's `max_dynamic_shared_size_bytes`).

Each launch runs under a random warp schedule (see cuda_cpu_emulator.h) whose seed is derived
from the loader's `seed` ($CUDA_EMU_SEED, default 0), the kernel, its launch count and the launch
shape, so runs are reproducible and different launches see different schedules. The dynamic
shared memory is exactly `shared_mem` bytes, NaN-filled, with guard bytes around it: an access
past it or a divergent barrier raises `EmulatorFault`, which names the seed.
Compiled libraries are cached on disk, keyed by the generated source text.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core_engine.kernels.cpu.kernel_loader import compile_shared_library
from core_engine.kernels.cuda.module_loader import KERNEL_DIR, load_source

HEADER = Path(__file__).resolve().with_name("cuda_cpu_emulator.h")
TAIL_HEADER = Path(__file__).resolve().with_name("cuda_cpu_emulator_tail.h")
SHARED_MEM_BYTES = 256 * 1024  # kMaxSharedBytes in the header
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024  # above it, CUDA needs max_dynamic_shared_size_bytes
COMPILE_FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w")
SEED_ENV = "CUDA_EMU_SEED"
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_ALIGN = r"(?:__align__\s*\(\s*\d+\s*\)\s*|alignas\s*\(\s*\d+\s*\)\s*)?"
_DYNAMIC_SHARED = re.compile(
    rf"\bextern\s+{_ALIGN}__shared__\s+{_ALIGN}(?P<type>\w+)\s+{_ALIGN}(?P<name>\w+)"
    r"\s*\[\s*\]\s*;"
)
_STATIC_SHARED = re.compile(
    rf"\b__shared__\s+{_ALIGN}(?P<type>[A-Za-z_][\w:<>, ]*?)\s+{_ALIGN}(?P<name>[A-Za-z_]\w*)"
    r"\s*(?P<dims>(?:\[[^\]]+\]\s*)*);"
)


class EmulatorFault(RuntimeError):
    """A launch the emulator stopped: shared memory out of bounds, or a divergent barrier."""


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def cache_dir() -> Path:
    root = os.environ.get("CORE_ENGINE_TEST_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "core-engine-tests"
    return base / "cuda-cpu-emulator"


def mask_comments(text: str) -> str:
    """`text` with every comment blanked to spaces (newlines kept), so offsets stay valid."""
    return _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def rewrite_shared_declarations(source: str) -> str:
    """Turns `__shared__` declarations into macros for the emulator's per-block shared memory.

    `extern __shared__ T name[];` becomes a `T*` to the launch's dynamic shared memory (every
    such name aliases it, as on the GPU); `__shared__ T name[N];` becomes a reference to the
    block's instance of that array, key k for the k-th declaration.
    """
    pieces: list[str] = []
    code = mask_comments(source)
    position = 0
    key = 0
    for match in sorted(
        [*_DYNAMIC_SHARED.finditer(code), *_STATIC_SHARED.finditer(code)], key=lambda m: m.start()
    ):
        if match.start() < position:
            continue  # the static pattern also matches inside an extern declaration
        name, type_name = match.group("name"), match.group("type").strip()
        if match.re is _DYNAMIC_SHARED:
            value = f"(reinterpret_cast<{type_name}*>(emu::g_dynamic_shared))"
        else:
            dims = re.sub(r"\s+", "", match.group("dims"))
            value = f"(emu::static_shared<{type_name}{dims}>({key}))"
            key += 1
        pieces += [source[position : match.start()], f"\n#define {name} {value}\n"]
        position = match.end()
    pieces.append(source[position:])
    return "".join(pieces)


def translation_unit(source_name: str, name_expression: str, source_dir: Path = KERNEL_DIR) -> str:
    """Host C++ for one kernel instance: emulator headers, kernel source, entry points."""
    source = rewrite_shared_declarations(load_source(source_name, source_dir))
    # The tail emulates instructions (MMA) declared by common.cuh, so only its users get it.
    tail = f'#include "{TAIL_HEADER}"\n' if "host_mma_m16n8k16" in source else ""
    return (
        f'#include "{HEADER}"\n{source}\n{tail}'
        'extern "C" int emu_launch(const unsigned int* grid, const unsigned int* block, '
        "void** args, unsigned long long shared_bytes, unsigned long long seed) {\n"
        f"  return emu::launch(&{name_expression}, grid, block, args, shared_bytes, seed);\n}}\n"
        'extern "C" const char* emu_last_error() { return emu::g_error; }\n'
        'extern "C" int emu_param_sizes(int* sizes) {\n'
        f"  return emu::param_sizes(&{name_expression}, sizes);\n}}\n"
    )


def build_library(text: str) -> Path:
    """Compiles `text` to a shared library once and returns its path.

    Cached by the text, the emulator headers' contents and the flags.
    """
    key = text + HEADER.read_text() + TAIL_HEADER.read_text() + " ".join(COMPILE_FLAGS)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    target = cache_dir() / f"kernel-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cpp = Path(tmp) / "kernel.cpp"
        cpp.write_text(text)
        compile_shared_library(["g++", *COMPILE_FLAGS], [cpp], target)
    return target


def default_seed() -> int:
    """The base schedule seed: $CUDA_EMU_SEED, else 0."""
    return int(os.environ.get(SEED_ENV, "0"), 0)


def launch_seed(base_seed: int, name_expression: str, launch_index: int, *shape: Any) -> int:
    """The 64-bit schedule seed of one launch (stable across processes, unlike `hash`)."""
    key = repr((base_seed, name_expression, launch_index, *shape)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class EmulatedKernel:
    """A compiled kernel instance, called like `cupy.RawKernel.__call__`.

    Launch i runs under the schedule seed `launch_seed(seed, name, i, grid, block, shared_mem)`;
    `last_seed` holds the latest one.
    """

    def __init__(self, library_path: Path, name_expression: str, seed: int = 0) -> None:
        self.name_expression = name_expression
        self.seed = seed
        self.last_seed: int | None = None
        self._lib = ctypes.CDLL(str(library_path))
        self._lib.emu_launch.restype = ctypes.c_int
        self._lib.emu_launch.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
        ]
        self._lib.emu_last_error.restype = ctypes.c_char_p
        sizes = (ctypes.c_int * 64)()
        count = self._lib.emu_param_sizes(sizes)
        self.param_sizes = tuple(sizes[:count])
        self.num_launches = 0
        self.max_dynamic_shared_size_bytes = 0  # as on a cupy.RawKernel; the loader raises it

    def __call__(
        self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None
    ) -> None:
        self._check(grid, block, args, shared_mem)
        holders = [np.array(arg) for arg in args]
        pointers = (ctypes.c_void_p * len(holders))(*[h.ctypes.data for h in holders])
        grid3 = (ctypes.c_uint * 3)(*grid)
        block3 = (ctypes.c_uint * 3)(*block)
        seed = launch_seed(
            self.seed,
            self.name_expression,
            self.num_launches,
            tuple(grid),
            tuple(block),
            shared_mem,
        )
        self.last_seed = seed
        self.num_launches += 1
        if not self._lib.emu_launch(grid3, block3, pointers, shared_mem, seed):
            error = self._lib.emu_last_error().decode()
            raise EmulatorFault(
                f"{self.name_expression} grid={tuple(grid)} block={tuple(block)} "
                f"shared_mem={shared_mem} (schedule seed {seed:#x}): {error}"
            )

    def _check(self, grid: tuple, block: tuple, args: tuple, shared_mem: int) -> None:
        name = self.name_expression
        if len(grid) != 3 or len(block) != 3 or min(grid) <= 0 or min(block) <= 0:
            raise ValueError(f"{name}: bad launch shape grid={grid} block={block}")
        if shared_mem > SHARED_MEM_BYTES:
            raise ValueError(f"{name}: {shared_mem} bytes of shared memory requested")
        limit = max(DEFAULT_DYNAMIC_SHARED_LIMIT, self.max_dynamic_shared_size_bytes)
        if shared_mem > limit:
            raise ValueError(
                f"{name}: {shared_mem} bytes of dynamic shared memory above the kernel's limit "
                f"of {limit} (get_kernel was not given the size)"
            )
        if len(args) != len(self.param_sizes):
            raise TypeError(f"{name}: {len(args)} arguments for {len(self.param_sizes)} parameters")
        for index, (arg, size) in enumerate(zip(args, self.param_sizes, strict=True)):
            if not isinstance(arg, np.generic):
                raise TypeError(
                    f"{name}: argument {index} is {type(arg).__name__}, not a NumPy scalar"
                )
            if arg.itemsize != size:
                raise TypeError(
                    f"{name}: argument {index} has {arg.itemsize} bytes, the parameter {size}"
                )


@dataclass(slots=True)
class EmulatedLoader:
    """Drop-in for `ModuleLoader`: compiles each (source, name expression) once, for the CPU.

    `seed` is the base of every launch's schedule seed (see `EmulatedKernel`).
    """

    source_dir: Path = KERNEL_DIR
    seed: int = field(default_factory=default_seed)
    kernels: dict[tuple[str, str], EmulatedKernel] = field(default_factory=dict)

    @property
    def num_compiled(self) -> int:
        return len(self.kernels)

    def get_kernel(
        self, source_name: str, name_expression: str, device_index: Any, shared_mem_bytes: int = 0
    ) -> EmulatedKernel:
        key = (source_name, name_expression)
        if key not in self.kernels:
            text = translation_unit(source_name, name_expression, self.source_dir)
            self.kernels[key] = EmulatedKernel(build_library(text), name_expression, self.seed)
        kernel = self.kernels[key]
        kernel.max_dynamic_shared_size_bytes = max(
            kernel.max_dynamic_shared_size_bytes, shared_mem_bytes
        )
        return kernel


def launch_on_cpu(kernel: EmulatedKernel, grid, block, args, shared_mem, device) -> None:
    """Replacement for `cuda_backend._launch`: same contract, no CuPy, no stream."""
    if min(grid) <= 0:
        return
    kernel(grid, block, args, shared_mem=shared_mem)
