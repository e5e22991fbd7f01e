"""Run the real `kernels/*.cu` sources on the CPU, for tests on machines without a GPU.

`EmulatedLoader` is a drop-in for `kernels.module_loader.ModuleLoader`: `get_kernel` compiles
one kernel instance as host C++ (g++) against `cuda_cpu_emulator.h` and returns an
`EmulatedKernel`, callable like a `cupy.RawKernel` with `(grid, block, args, shared_mem=...)`.
Pointer arguments are host addresses, so the tensors are CPU tensors. Every call checks the
argument packing the way the GPU would need it: each argument must be a NumPy scalar whose size
equals the kernel parameter's size (a Python int or float, or an int64 where the kernel takes an
int, is an error), the grid must be non-empty, and the shared memory must fit.
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

from kernels.cpu_kernel_loader import compile_shared_library
from kernels.module_loader import KERNEL_DIR, load_source

HEADER = Path(__file__).resolve().with_name("cuda_cpu_emulator.h")
TAIL_HEADER = Path(__file__).resolve().with_name("cuda_cpu_emulator_tail.h")
SHARED_MEM_BYTES = 256 * 1024
COMPILE_FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w")
_SHARED_DECL = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]")


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def cache_dir() -> Path:
    root = os.environ.get("CORE_ENGINE_TEST_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "core-engine-tests"
    return base / "cuda-cpu-emulator"


def translation_unit(source_name: str, name_expression: str, source_dir: Path = KERNEL_DIR) -> str:
    """Host C++ for one kernel instance: emulator headers, kernel source, shared arrays, entry."""
    source = load_source(source_name, source_dir)
    shared = {name: type_name for type_name, name in _SHARED_DECL.findall(source)}
    # The tail emulates instructions (MMA) declared by cuda_common.cuh, so only its users get it.
    tail = f'#include "{TAIL_HEADER}"\n' if "host_mma_m16n8k16" in source else ""
    shared_defs = "".join(
        f"alignas(16) {type_name} {name}[{SHARED_MEM_BYTES} / sizeof({type_name})];\n"
        for name, type_name in sorted(shared.items())
    )
    return (
        f'#include "{HEADER}"\n{source}\n{tail}{shared_defs}'
        'extern "C" void emu_launch(const unsigned int* grid, const unsigned int* block, '
        "void** args) {\n"
        f"  emu::launch(&{name_expression}, grid, block, args);\n}}\n"
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


class EmulatedKernel:
    """A compiled kernel instance, called like `cupy.RawKernel.__call__`."""

    def __init__(self, library_path: Path, name_expression: str) -> None:
        self.name_expression = name_expression
        self._lib = ctypes.CDLL(str(library_path))
        sizes = (ctypes.c_int * 64)()
        count = self._lib.emu_param_sizes(sizes)
        self.param_sizes = tuple(sizes[:count])
        self.num_launches = 0

    def __call__(
        self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None
    ) -> None:
        self._check(grid, block, args, shared_mem)
        holders = [np.array(arg) for arg in args]
        pointers = (ctypes.c_void_p * len(holders))(*[h.ctypes.data for h in holders])
        grid3 = (ctypes.c_uint * 3)(*grid)
        block3 = (ctypes.c_uint * 3)(*block)
        self._lib.emu_launch(grid3, block3, pointers)
        self.num_launches += 1

    def _check(self, grid: tuple, block: tuple, args: tuple, shared_mem: int) -> None:
        name = self.name_expression
        if len(grid) != 3 or len(block) != 3 or min(grid) <= 0 or min(block) <= 0:
            raise ValueError(f"{name}: bad launch shape grid={grid} block={block}")
        if shared_mem > SHARED_MEM_BYTES:
            raise ValueError(f"{name}: {shared_mem} bytes of shared memory requested")
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
    """Drop-in for `ModuleLoader`: compiles each (source, name expression) once, for the CPU."""

    source_dir: Path = KERNEL_DIR
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
            self.kernels[key] = EmulatedKernel(build_library(text), name_expression)
        return self.kernels[key]


def launch_on_cpu(kernel: EmulatedKernel, grid, block, args, shared_mem, device) -> None:
    """Replacement for `cuda_backend._launch`: same contract, no CuPy, no stream."""
    if min(grid) <= 0:
        return
    kernel(grid, block, args, shared_mem=shared_mem)
