"""Helpers for the tests of the CPU C kernels: a library build that holds the kernel under
test, and the float32-summation check of the matmul kernels."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable

import pytest
import torch

from kernels import cpu_kernel_loader
from worker.cpu_features import host_cpu_flags


def avx2_kernel_library(
    holds_kernel: Callable[[ctypes.CDLL], bool], what: str, tmp_path_factory
) -> ctypes.CDLL:
    """The default kernel library if it holds the kernel (`holds_kernel`), else, on a CPU with
    AVX-512 (whose default build leaves the AVX2-only kernels out), the AVX2 build compiled
    with `-mno-avx512f` into a temporary cache. Skips where there is no compiler or no
    AVX2/FMA, naming `what` needs them."""
    default = cpu_kernel_loader.load()
    if default is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    if holds_kernel(default):
        return default
    if not {"avx2", "fma"} <= host_cpu_flags():
        pytest.skip(f"this CPU has no AVX2/FMA, which {what} needs")
    compiler = shutil.which("cc") or shutil.which("gcc")
    cache = tmp_path_factory.mktemp("avx2-kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_kernel_loader.CACHE_ENV, str(cache))
        built = cpu_kernel_loader.build(compiler, ("-mno-avx512f",))
    library = cpu_kernel_loader.open_library(built)
    assert holds_kernel(library), f"the AVX2 build does not hold {what}"
    return library


def assert_float32_sums(out, x, weight, bias=None) -> None:
    """`out` is x @ weight^T (+ bias) summed in float32: within 1e-6 of the sum of |products|
    of the float64 result (float32 summation error over any k the tests use)."""
    expected = x.double() @ weight.double().T
    bound = (x.double().abs() @ weight.double().abs().T) * 1e-6 + 1e-6
    if bias is not None:
        expected = expected + bias.double()
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert bool(((out.double() - expected).abs() <= bound).all())
