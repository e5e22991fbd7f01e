"""Cached NVRTC loader for the `.cu` kernels: compile once per configuration and device.

A configuration is one kernel name expression (a template instance such as
`decode_attention<bf16_t, 128, 4>`) in one source file. Sources include only local `.cuh`
headers, which `load_source` inlines, so NVRTC needs no include path and CuPy's on-disk kernel
cache (keyed by the source text) sees header changes too. CuPy is imported lazily: this module
imports on machines without it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent
NVRTC_OPTIONS = ("-std=c++17",)
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)


def load_source(source_name: str, source_dir: Path = KERNEL_DIR) -> str:
    """The text of `source_name` with every local `#include "x.cuh"` inlined once.

    Raises FileNotFoundError for a missing file or header.
    """
    return _expand(source_dir / source_name, source_dir, set())


def _expand(path: Path, source_dir: Path, included: set[str]) -> str:
    text = _PRAGMA_ONCE.sub("", path.read_text())

    def inline(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in included:
            return f"// {header} already included\n"
        included.add(header)
        return f"// begin {header}\n{_expand(source_dir / header, source_dir, included)}// end {header}\n"

    return _LOCAL_INCLUDE.sub(inline, text)


@dataclass(slots=True)
class ModuleLoader:
    """Compiles each (source file, name expression) once per device and keeps the kernel.

    `get_kernel` returns a `cupy.RawKernel`; its dynamic shared-memory limit is raised to at
    least `shared_mem_bytes` (needed above 48 KB). Not thread-safe: one worker, one thread.
    """

    source_dir: Path = KERNEL_DIR
    options: tuple[str, ...] = NVRTC_OPTIONS
    _kernels: dict[tuple[str, str, int], Any] = field(default_factory=dict)
    _shared_limits: dict[tuple[str, str, int], int] = field(default_factory=dict)

    @property
    def num_compiled(self) -> int:
        return len(self._kernels)

    def compiled_names(self) -> set[str]:
        """The name expressions compiled so far (on any device): which kernels have run."""
        return {name for (_, name, _) in self._kernels}

    def get_kernel(
        self, source_name: str, name_expression: str, device_index: int, shared_mem_bytes: int = 0
    ) -> Any:
        key = (source_name, name_expression, device_index)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._compile(source_name, name_expression, device_index)
            self._kernels[key] = kernel
            self._shared_limits[key] = 0
        if shared_mem_bytes > max(self._shared_limits[key], 48 * 1024):
            import cupy

            with cupy.cuda.Device(device_index):
                kernel.max_dynamic_shared_size_bytes = shared_mem_bytes
            self._shared_limits[key] = shared_mem_bytes
        return kernel

    def _compile(self, source_name: str, name_expression: str, device_index: int) -> Any:
        import cupy

        module = cupy.RawModule(
            code=load_source(source_name, self.source_dir),
            options=self.options,
            name_expressions=(name_expression,),
        )
        with cupy.cuda.Device(device_index):
            return module.get_function(name_expression)


@functools.cache
def default_loader() -> ModuleLoader:
    """The process-wide loader the CUDA backend uses (one compile per configuration)."""
    return ModuleLoader()
