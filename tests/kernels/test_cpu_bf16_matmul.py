"""The bf16 x bf16 matmul kernel of the CPU worker (bf16 linears, float32 LM head) against
float64.

Products of bf16 values are exact in float32 and the kernel sums in float32, so its float32
output agrees with a float64 matmul of the same bf16 operands to float32 summation error
(about sqrt(k) * 2^-24 of the sum of |products|), and its bf16 output is that float32 result
rounded once, to nearest even.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.bf16_matmul import Bf16MatmulWeight
from core_engine.worker.model_executor.cpu_linear import pack_linears
from core_engine.worker.model_executor.layers import ColumnParallelLinear, ParallelLMHead
from tests.helpers.cpu_kernel_builds import (
    AVX512_BF16,
    assert_float32_sums,
    kernel_library,
    requires_cpu_flags,
)

pytestmark = requires_cpu_flags(*AVX512_BF16.cpu_flags, kernel="bf16_matmul.c")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return kernel_library(AVX512_BF16, tmp_path_factory)


@pytest.fixture(autouse=True)
def kernel(library, monkeypatch):
    """Makes `cpu_kernel_loader.load` return the library under test."""
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    return library


def bf16_randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# Rows 1..13 cover every row tail of the 6-row tiles; 70 and 200 columns end inside a tile.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize(("columns", "k"), [(64, 2), (70, 576), (200, 30)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_float32_output_matches_float64_for_every_tail(rows, columns, k, num_threads):
    weight = bf16_randn(columns, k, seed=columns)
    x = bf16_randn(rows, k, seed=rows)
    packed = Bf16MatmulWeight.pack(weight)
    assert packed is not None and packed.padded_columns % 64 == 0
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = packed.matmul(x, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(previous)
    assert out.is_contiguous()
    assert_float32_sums(out, x, weight)


@pytest.mark.parametrize("columns", [64, 100])
def test_bf16_output_is_the_float32_result_rounded_once_with_bias(columns):
    weight, x = bf16_randn(columns, 48, seed=1), bf16_randn(2, 3, 48, seed=2)
    bias = torch.randn(columns)
    packed = Bf16MatmulWeight.pack(weight)
    exact = packed.matmul(x, bias, torch.float32)
    assert_float32_sums(exact.view(6, columns), x.view(6, 48), weight, bias)
    out = packed.matmul(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, columns)
    assert torch.equal(out, exact.bfloat16())


def test_float32_input_is_rounded_to_bf16_first():
    weight = bf16_randn(64, 8, seed=0)
    x = torch.randn(3, 8)
    out = Bf16MatmulWeight.pack(weight).matmul(x, out_dtype=torch.float32)
    assert_float32_sums(out, x.bfloat16(), weight)


def test_what_the_kernel_cannot_take_is_refused():
    assert Bf16MatmulWeight.pack(torch.randn(64, 8)) is None  # float32
    assert Bf16MatmulWeight.pack(bf16_randn(64, 7, seed=0)) is None  # odd k
    assert Bf16MatmulWeight.pack(bf16_randn(64, seed=0)) is None  # not a matrix
    packed = Bf16MatmulWeight.pack(bf16_randn(64, 8, seed=0))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        packed.matmul(torch.randn(2, 6))
    with pytest.raises(ValueError, match="float16"):
        packed.matmul(torch.randn(2, 8), out_dtype=torch.float16)


def test_bf16_linears_run_on_the_kernel_and_round_like_torch():
    layer = ColumnParallelLinear(40, 72, bias=True)
    layer.weight.data, layer.bias.data = bf16_randn(72, 40, seed=5), bf16_randn(72, seed=6)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert pack_linears(layer) == 1
    assert layer.kernel_weight is not None and layer.packed_weight is None and layer.weight is None
    x = bf16_randn(11, 40, seed=7)
    out = layer(x)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert out.dtype == torch.bfloat16
    # one rounding of a float32 sum: within half a bf16 step (2^-8 relative) plus float32 error
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-5)


def test_bf16_lm_head_gives_float32_logits_from_the_kernel():
    head = ParallelLMHead(100, 32)
    head.weight.data = bf16_randn(100, 32, seed=3)
    weight = head.weight.detach().clone()
    assert head.pack(keep_dense_weight=False)
    assert head.kernel_weight is not None and head.weight is None and head.packed_weight is None
    x = bf16_randn(9, 32, seed=4)
    logits = head.compute_logits(x)
    assert logits.shape == (9, 100)
    assert_float32_sums(logits, x, weight)
