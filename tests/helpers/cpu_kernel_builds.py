"""Helpers for the tests of the CPU C kernels: the kinds of kernel build (one per kind of CPU)
and what each reports, a library of a given build that this host runs, the marker of tests
that need CPU instructions a host may lack (with the skip reason and the end-of-run listing
tests/conftest.py prints), and the float32-summation check of the matmul kernels.

The routing code takes what a build reports as an argument, so its tests run everywhere with
every build's capabilities; only the kernels need the instructions. `test_cpu_kernel_builds.py`
compiles every build from any x86-64 host and checks that each reports what this table says.
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.backend import CpuAttentionCapabilities, attention_capabilities
from core_engine.worker.cpu_features import host_cpu_flags, simd_level

# The attention shape the builds' capabilities are given for: 6 query heads over 2 KV heads
# (a GQA group of 3), head size 64, blocks of 16 tokens.
ATTENTION_SHAPE = (6, 2, 64, 16)
# The flags the kernels' #if conditions read under -march=native, listed in the run's summary.
KERNEL_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One kind of kernel library: what `-march=native` compiles on one kind of CPU."""

    name: str
    cpu_flags: tuple[str, ...]  # a CPU has these iff -march=native gives it this build or a wider
    narrowing_flags: tuple[str, ...]  # after COMPILE_FLAGS: this build on a CPU of a wider one
    target_flags: tuple[str, ...]  # after COMPILE_FLAGS: this build from any x86-64 host
    attention: CpuAttentionCapabilities  # what it reports for ATTENTION_SHAPE
    f32_matmul_panel_columns: int  # 0: no f32_matmul.c
    bf16_matmul_tile_columns: int  # 0: no bf16_matmul.c
    gguf_matmul_panels: bool  # gguf_matmul.c runs prompts on f32_matmul's micro-kernel
    gguf_matmul_integer_bits: int  # x's bits on gguf_matmul.c's integer path; 0: no such path
    gguf_matmul_byte_bits: int  # x's bits on gguf_matmul.c's byte path; 0: no such path

    @property
    def readings(self) -> tuple[int, ...]:
        """What `read_build` gets from a library of this build."""
        return (
            self.attention.vector_floats,
            int(self.attention.bf16_fast_path),
            self.attention.prefill_tile_tokens,
            self.f32_matmul_panel_columns,
            self.bf16_matmul_tile_columns,
            int(self.gguf_matmul_panels),
            self.gguf_matmul_integer_bits,
            self.gguf_matmul_byte_bits,
        )


PLAIN_C = KernelBuild(
    "plain-c",
    cpu_flags=(),
    narrowing_flags=("-mno-avx512f", "-mno-avx2", "-mno-fma"),
    target_flags=("-march=x86-64",),
    attention=CpuAttentionCapabilities(
        vector_floats=1, bf16_fast_path=False, prefill_tile_tokens=0
    ),
    f32_matmul_panel_columns=0,
    bf16_matmul_tile_columns=0,
    gguf_matmul_panels=False,
    gguf_matmul_integer_bits=0,
    gguf_matmul_byte_bits=0,
)
AVX2 = KernelBuild(
    "avx2",
    cpu_flags=("avx2", "fma"),
    narrowing_flags=("-mno-avx512f",),
    target_flags=("-march=x86-64-v3",),
    attention=CpuAttentionCapabilities(
        vector_floats=8, bf16_fast_path=False, prefill_tile_tokens=32
    ),
    f32_matmul_panel_columns=16,
    bf16_matmul_tile_columns=0,
    gguf_matmul_panels=True,
    gguf_matmul_integer_bits=16,
    gguf_matmul_byte_bits=8,
)
AVX512 = KernelBuild(
    "avx512",
    cpu_flags=("avx2", "fma", "avx512f"),
    narrowing_flags=("-mno-avx512bf16",),
    target_flags=("-march=x86-64-v4",),
    attention=CpuAttentionCapabilities(
        vector_floats=16, bf16_fast_path=False, prefill_tile_tokens=0
    ),
    f32_matmul_panel_columns=0,
    bf16_matmul_tile_columns=0,
    gguf_matmul_panels=False,
    gguf_matmul_integer_bits=16,
    gguf_matmul_byte_bits=8,
)
AVX512_BF16 = KernelBuild(
    "avx512-bf16",
    cpu_flags=("avx2", "fma", "avx512f", "avx512_bf16"),
    narrowing_flags=(),
    target_flags=("-march=x86-64-v4", "-mavx512bf16"),
    attention=CpuAttentionCapabilities(
        vector_floats=16, bf16_fast_path=True, prefill_tile_tokens=0
    ),
    f32_matmul_panel_columns=0,
    bf16_matmul_tile_columns=64,
    gguf_matmul_panels=False,
    gguf_matmul_integer_bits=16,
    gguf_matmul_byte_bits=8,
)
KERNEL_BUILDS = (PLAIN_C, AVX2, AVX512, AVX512_BF16)  # narrowest first


def host_build(flags: frozenset[str] | None = None) -> KernelBuild:
    """The build -march=native gives on a CPU with `flags` (default: this one's)."""
    flags = host_cpu_flags() if flags is None else flags
    return next(build for build in reversed(KERNEL_BUILDS) if flags.issuperset(build.cpu_flags))


def read_build(library: ctypes.CDLL) -> tuple[int, ...]:
    """What a library reports, in `KernelBuild.readings` order (the attention part through
    the backend's own reader)."""
    capabilities = attention_capabilities(library, *ATTENTION_SHAPE)
    return (
        capabilities.vector_floats,
        int(capabilities.bf16_fast_path),
        capabilities.prefill_tile_tokens,
        library.f32_matmul_panel_columns(),
        library.bf16_matmul_tile_columns(),
        library.gguf_matmul_has_panels(),
        library.gguf_matmul_integer_bits(),
        library.gguf_matmul_byte_bits(),
    )


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def kernel_library(build: KernelBuild, tmp_path_factory) -> ctypes.CDLL:
    """A library of `build` that this host runs: the default one where this CPU's build is
    `build`, else the default build narrowed by `build.narrowing_flags`, compiled into the
    session's temporary directory (once per session). Tests that call it carry
    `requires_cpu_flags(*build.cpu_flags, ...)`; it skips where there is no compiler, or where
    the default build does not report what this CPU's flags say it should (a compiler too old
    for them: `test_default_build_is_the_one_the_cpu_flags_name` fails there)."""
    default = cpu_kernel_loader.load()
    if default is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    if host_build() != build:
        directory = tmp_path_factory.getbasetemp() / "kernel-builds"
        path = cpu_kernel_loader.build(compiler(), build.narrowing_flags, directory)
        library = cpu_kernel_loader.open_library(path)
        assert read_build(library) == build.readings, f"{build.narrowing_flags} is no {build.name}"
        return library
    if read_build(default) != build.readings:
        pytest.skip(
            f"the default build on this CPU ({simd_level(host_cpu_flags())}) reports "
            f"{read_build(default)}, not the {build.name} build's {build.readings}"
        )
    return default


def use_kernel_library(build: KernelBuild, tmp_path_factory, monkeypatch) -> ctypes.CDLL:
    """`kernel_library(build)`, made what `cpu_kernel_loader.load` returns for the test."""
    library = kernel_library(build, tmp_path_factory)
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    return library


def kernel_library_fixtures(kernel: str) -> tuple:
    """A test module's `build` and `kernel` fixtures for `kernel` (a C file): `build` one of
    `build_params(kernel)` (every build the host can run), `kernel` that build's library, made
    what `cpu_kernel_loader.load` returns. Use: `build, kernel = kernel_library_fixtures(...)`."""

    @pytest.fixture(params=build_params(kernel))
    def build(request):
        return request.param

    @pytest.fixture
    def kernel(build, tmp_path_factory, monkeypatch):
        return use_kernel_library(build, tmp_path_factory, monkeypatch)

    return build, kernel


def requires_cpu_flags(*flags: str, kernel: str) -> pytest.MarkDecorator:
    """Marks a test of `kernel` (a C file, or a path in one) that runs instructions only CPUs
    with every one of `flags` have. tests/conftest.py skips it elsewhere, with
    `missing_flags_reason`, and lists every marked test that skipped, for whatever reason, at
    the end of the run (`skipped_kernel_tests_summary`)."""
    return pytest.mark.cpu_kernel(*flags, kernel=kernel)


def build_params(kernel: str) -> list:
    """One pytest param per build in KERNEL_BUILDS (id: its name), each marked to run only on
    a CPU with the build's flags: a test of `kernel` on every build the host can run."""
    return [
        pytest.param(build, marks=requires_cpu_flags(*build.cpu_flags, kernel=kernel),
                     id=build.name)
        for build in KERNEL_BUILDS
    ]  # fmt: skip


def missing_flags_reason(
    flags: Iterable[str], kernel: str, host_flags: frozenset[str]
) -> str | None:
    """Why a test of `kernel` needing `flags` skips on a CPU with `host_flags`; None if it
    runs there."""
    missing = [flag for flag in flags if flag not in host_flags]
    if not missing:
        return None
    return f"needs {' '.join(missing)} (this CPU: {simd_level(host_flags)}): {kernel}"


def describe_cpu(host_flags: frozenset[str]) -> str:
    """The CPU's widest extension and which of the kernels' flags it has and lacks."""
    has = [flag for flag in KERNEL_CPU_FLAGS if flag in host_flags]
    lacks = [flag for flag in KERNEL_CPU_FLAGS if flag not in host_flags]
    return f"{simd_level(host_flags)}: has {' '.join(has) or 'none'}; lacks {' '.join(lacks) or 'none'}"


def skipped_kernel_tests_summary(
    skipped: Iterable[tuple[str, str]], num_ran: int, host_flags: frozenset[str]
) -> tuple[str, list[str]]:
    """The heading and lines that list the kernel tests (`skipped`: node id and reason) this
    host skipped, by reason; several cases of one parametrized test under one reason go on one
    line. `num_ran`: how many marked tests ran."""
    by_reason: dict[str, dict[str, list[str]]] = {}
    for node_id, reason in skipped:
        test = node_id.split("[", 1)[0]
        by_reason.setdefault(reason, {}).setdefault(test, []).append(node_id)
    num_skipped = sum(len(ids) for tests in by_reason.values() for ids in tests.values())
    heading = (
        f"CPU kernel tests: {num_ran} ran, {num_skipped} skipped on this CPU "
        f"({describe_cpu(host_flags)})"
    )
    lines = []
    for reason, tests in sorted(by_reason.items()):
        lines.append(reason)
        for test, node_ids in tests.items():
            lines.append(
                f"    {test} ({len(node_ids)} cases)" if len(node_ids) > 1 else f"    {node_ids[0]}"
            )
    return heading, lines


def assert_float32_sums(out, x, weight, bias=None) -> None:
    """`out` is x @ weight^T (+ bias) summed in float32: within 1e-6 of the sum of |products|
    of the float64 result (float32 summation error over any k the tests use)."""
    expected = x.double() @ weight.double().T
    bound = (x.double().abs() @ weight.double().abs().T) * 1e-6 + 1e-6
    if bias is not None:
        expected = expected + bias.double()
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert bool(((out.double() - expected).abs() <= bound).all())
