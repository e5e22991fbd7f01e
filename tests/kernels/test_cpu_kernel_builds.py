"""Every kind of CPU's kernel build, from any host: each compiles, and reports the
capabilities the routing tests give it (tests/helpers/cpu_kernel_builds.py); this host's default build
is the one its CPU flags name; and the marking of kernel tests that a CPU cannot run (their
skip reason and the list at the end of the run) works.

The x86 builds compile on any x86-64 host with a C compiler (GCC and Clang target any x86 ISA
whatever the host runs), so an AVX2 host catches a build break of the AVX-512 kernels. Only
their capability functions run (in a subprocess: plain integer code in every build); the
kernels themselves run in test_cpu_backend.py and the kernel tests, where the CPU has them.
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys

import pytest

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.worker.cpu_features import host_cpu_flags
from core_engine.worker.model_executor.cpu_linear import CpuLinearCapabilities
from tests.helpers.cpu_kernel_builds import (
    ATTENTION_SHAPE,
    AVX2,
    AVX512,
    AVX512_BF16,
    KERNEL_BUILDS,
    PLAIN_C,
    compiler,
    describe_cpu,
    host_build,
    missing_flags_reason,
    read_build,
    requires_cpu_flags,
    skipped_kernel_tests_summary,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = ATTENTION_SHAPE
# Prints what a library reports, in KernelBuild.readings order, with ctypes alone.
READ_BUILD = f"""
import ctypes, json, sys
library = ctypes.CDLL(sys.argv[1])
print(json.dumps([
    library.paged_attention_vector_floats(),
    library.paged_attention_bf16_fast_path({HEAD_DIM}, {BLOCK_SIZE}),
    library.prefill_attention_tile_tokens({NUM_Q_HEADS // NUM_KV_HEADS}, {HEAD_DIM}),
    library.f32_matmul_panel_columns(),
    library.bf16_matmul_tile_columns(),
    library.gguf_matmul_has_panels(),
    library.gguf_matmul_integer_bits(),
    library.gguf_matmul_byte_bits(),
]))
"""
IS_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma"})


@pytest.mark.slow  # four compilations
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            build, id=build.name, marks=requires_cpu_flags(kernel=f"{build.name} build (compile)")
        )
        for build in KERNEL_BUILDS
    ],
)
def test_every_build_compiles_here_and_reports_its_capabilities(build, tmp_path_factory):
    """The build this kind of CPU compiles, compiled with the loader's own command (its -march
    last), and what its capability functions report."""
    if not IS_X86_64:
        pytest.skip(f"the x86 builds need an x86-64 compiler (this machine: {platform.machine()})")
    if compiler() is None:
        pytest.skip("no C compiler")
    directory = tmp_path_factory.getbasetemp() / "kernel-targets"
    path = cpu_kernel_loader.build(compiler(), build.target_flags, directory)
    result = subprocess.run(
        [sys.executable, "-c", READ_BUILD, str(path)], capture_output=True, text=True, timeout=60
    )
    if result.returncode == -signal.SIGILL:
        reason = missing_flags_reason(
            build.cpu_flags, f"{build.name} build's capabilities", host_cpu_flags()
        )
        pytest.skip(reason or f"SIGILL reading the {build.name} build: {result.stderr[-500:]}")
    assert result.returncode == 0, result.stderr
    assert tuple(json.loads(result.stdout)) == build.readings


def test_default_build_is_the_one_the_cpu_flags_name():
    """-march=native gives this CPU the build its flags name (the kernels' #if conditions),
    and the backend and the linears read it as such."""
    library = cpu_kernel_loader.load()
    if library is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    build = host_build()
    assert read_build(library) == build.readings, f"{describe_cpu(host_cpu_flags())}"
    linear = CpuLinearCapabilities.read()
    assert linear.has_f32_matmul == (build.f32_matmul_panel_columns > 0)
    assert linear.has_bf16_matmul == (build.bf16_matmul_tile_columns > 0)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(AVX2_ONLY, AVX2, id="zen2"),
        pytest.param(AVX2_ONLY - {"fma"}, PLAIN_C, id="avx2-without-fma"),
        pytest.param(AVX2_ONLY | {"avx512f", "avx512bw"}, AVX512, id="skylake-x"),
        pytest.param(AVX2_ONLY | {"avx512f", "avx512_bf16"}, AVX512_BF16, id="zen4"),
        pytest.param(AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_bf16"}, AVX512_BF16, id="spr"),
        pytest.param(frozenset({"fp", "asimd"}), PLAIN_C, id="arm"),
    ],
)
def test_host_build_follows_the_cpu_flags(flags, expected):
    assert host_build(flags) is expected


def test_skip_reason_names_the_missing_flags_this_cpu_and_the_kernel():
    flags = ("avx2", "fma", "avx512f", "avx512_bf16")
    kernel = "bf16 fast path of paged_attention.c"
    assert missing_flags_reason(flags, kernel, AVX2_ONLY) == (
        "needs avx512f avx512_bf16 (this CPU: AVX2): bf16 fast path of paged_attention.c"
    )
    assert missing_flags_reason(flags, kernel, AVX2_ONLY | {"avx512f", "avx512_bf16"}) is None
    assert missing_flags_reason((), kernel, frozenset()) is None


def test_summary_lists_skipped_kernel_tests_by_reason():
    bf16 = "needs avx512_bf16 (this CPU: AVX2): bf16_matmul.c"
    skipped = [
        ("tests/a.py::test_tails[1-2]", bf16),
        ("tests/a.py::test_tails[3-4]", bf16),
        ("tests/a.py::test_bias", bf16),
        ("tests/b.py::test_builds[avx512]", "needs avx512f (this CPU: AVX2): x.c"),
    ]
    heading, lines = skipped_kernel_tests_summary(skipped, 7, AVX2_ONLY)
    assert heading == (
        "CPU kernel tests: 7 ran, 4 skipped on this CPU "
        "(AVX2: has avx2 fma; lacks avx512f avx512_bf16 amx_bf16)"
    )
    assert lines == [
        bf16,
        "    tests/a.py::test_tails (2 cases)",
        "    tests/a.py::test_bias",
        "needs avx512f (this CPU: AVX2): x.c",
        "    tests/b.py::test_builds[avx512]",
    ]


def test_a_run_skips_marked_tests_and_lists_them_at_its_end(pytester):
    """Through pytest itself, with this suite's hooks: a test needing a flag no CPU has skips
    with the reason, a marked test skipping for a reason of its own is listed too, a marked
    test that runs is counted, an unmarked skip is not listed."""
    pytester.makeini("[pytest]\nmarkers =\n    cpu_kernel(*cpu_flags, kernel): a CPU kernel test\n")
    pytester.makeconftest(
        "from tests.conftest import pytest_itemcollected, pytest_terminal_summary  # noqa: F401\n"
    )
    pytester.makepyfile(
        test_kernels="""
        import pytest
        from tests.helpers.cpu_kernel_builds import requires_cpu_flags

        @requires_cpu_flags("no_such_flag", kernel="k.c")
        def test_needs_a_flag_no_cpu_has():
            raise AssertionError("must not run")

        @requires_cpu_flags(kernel="other.c")
        @pytest.mark.parametrize("n", [1, 2])
        def test_skips_by_itself(n):
            pytest.skip("no compiler here")

        @requires_cpu_flags(kernel="k.c")
        def test_runs():
            pass

        def test_unmarked():
            pytest.skip("not a kernel test")
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=4)
    reason = missing_flags_reason(("no_such_flag",), "k.c", host_cpu_flags())
    result.stdout.fnmatch_lines(
        [
            f"*= CPU kernel tests: 1 ran, 3 skipped on this CPU ({describe_cpu(host_cpu_flags())}) =*",
            reason,
            "    test_kernels.py::test_needs_a_flag_no_cpu_has",
            "no compiler here",
            "    test_kernels.py::test_skips_by_itself (2 cases)",
        ],
        consecutive=True,
    )
    assert "not a kernel test" not in result.stdout.str()
