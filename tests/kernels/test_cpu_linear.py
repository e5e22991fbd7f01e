"""Packed CPU linears (oneDNN, or the project's float32/bf16 kernels where they are built): which
one each kind of CPU picks for each weight (on any host), and on this host the same results as
F.linear, one weight copy kept, tied weights kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.bf16_matmul import Bf16MatmulWeight
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.worker.model_executor.cpu_linear import (
    CpuLinearCapabilities,
    LinearKernel,
    can_pack,
    choose_kernel,
    pack_linears,
)
from core_engine.worker.model_executor.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# What each kind of CPU runs linears on: (has_bf16_matmul, has_f32_matmul, oneDNN's dtypes).
CPUS = {
    "plain-c": CpuLinearCapabilities(False, False, frozenset({F32})),
    "avx2": CpuLinearCapabilities(False, True, frozenset({F32})),
    "avx512": CpuLinearCapabilities(False, False, frozenset({F32, BF16})),
    "avx512-bf16": CpuLinearCapabilities(True, False, frozenset({F32, BF16})),
    "amx": CpuLinearCapabilities(True, False, frozenset({F32, BF16, F16})),
    "no-kernels-no-onednn": CpuLinearCapabilities(False, False, frozenset()),
}
# name: (weight dtype, in_features, packed_dtype); an LM head computes in float32.
WEIGHTS = {
    "f32": (F32, 16, None),
    "bf16": (BF16, 16, None),
    "f16": (F16, 16, None),
    "bf16-lm-head": (BF16, 16, F32),
    "bf16-odd-k": (BF16, 15, None),
    "bf16-odd-k-lm-head": (BF16, 15, F32),
}
K = LinearKernel
# The kernel each CPU picks for WEIGHTS, in order.
EXPECTED_KERNELS = {
    "plain-c": (K.ONEDNN, K.DENSE, K.DENSE, K.ONEDNN, K.DENSE, K.ONEDNN),
    "avx2": (K.F32_MATMUL, K.DENSE, K.DENSE, K.F32_MATMUL, K.DENSE, K.F32_MATMUL),
    "avx512": (K.ONEDNN, K.ONEDNN, K.DENSE, K.ONEDNN, K.ONEDNN, K.ONEDNN),
    "avx512-bf16": (K.ONEDNN, K.BF16_MATMUL, K.DENSE, K.BF16_MATMUL, K.ONEDNN, K.ONEDNN),
    "amx": (K.ONEDNN, K.BF16_MATMUL, K.ONEDNN, K.BF16_MATMUL, K.ONEDNN, K.ONEDNN),
    "no-kernels-no-onednn": (K.DENSE,) * 6,
}


@pytest.mark.parametrize("cpu", CPUS)
def test_each_cpu_picks_its_fastest_kernel_for_each_weight(cpu):
    """The bf16 kernel for a bf16 weight with an even k (also for an LM head: it outputs
    float32); else, in the dtype the layer computes in, the float32 kernel where it is built,
    then oneDNN where it runs the dtype, then nothing (F.linear on the dense weight)."""
    chosen = tuple(
        choose_kernel(torch.zeros(8, k, dtype=dtype), packed_dtype, CPUS[cpu])
        for dtype, k, packed_dtype in WEIGHTS.values()
    )
    assert dict(zip(WEIGHTS, chosen, strict=True)) == dict(
        zip(WEIGHTS, EXPECTED_KERNELS[cpu], strict=True)
    )


@pytest.mark.parametrize("cpu", CPUS)
def test_weights_that_are_not_cpu_matrices_stay_dense(cpu):
    assert choose_kernel(torch.zeros(16), None, CPUS[cpu]) is K.DENSE
    assert choose_kernel(torch.zeros(8, 16, device="meta"), None, CPUS[cpu]) is K.DENSE


class TinyTiedModel(nn.Module):
    """An embedding tied to the LM head, plus one column- and one row-parallel linear."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.device("cpu"):
            self.embed = VocabParallelEmbedding(50, 16)
            self.lm_head = ParallelLMHead(50, 16)
            self.up = ColumnParallelLinear(16, 40, bias=True)
            self.down = RowParallelLinear(40, 16)
        self.lm_head.weight = self.embed.weight
        generator = torch.Generator().manual_seed(0)
        for param in self.parameters():
            param.data = torch.randn(param.shape, generator=generator).to(dtype)


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_packed_linears_match_dense_matmuls(num_rows):
    model = TinyTiedModel()
    up_weight, up_bias = model.up.weight.clone(), model.up.bias.clone()
    down_weight, head_weight = model.down.weight.clone(), model.lm_head.weight.clone()
    x = torch.randn(num_rows, 16, generator=torch.Generator().manual_seed(1))
    assert pack_linears(model) == 3
    hidden = model.up(x)
    # Float32 rounding with a different summation order; outputs are O(10).
    torch.testing.assert_close(hidden, F.linear(x, up_weight, up_bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(model.down(hidden), hidden @ down_weight.T, atol=1e-4, rtol=1e-5)
    logits = model.lm_head.compute_logits(x)
    torch.testing.assert_close(logits, x @ head_weight.T, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packing_keeps_one_copy_except_for_tied_weights():
    model = TinyTiedModel()
    # float32 weights: the project's kernel where it is built (AVX2 without AVX-512), else oneDNN
    f32_kernel_built = CpuLinearCapabilities.read().has_f32_matmul
    pack_linears(model)
    assert model.up.weight is None and model.down.weight is None
    assert model.up.is_packed and model.up.bias is not None
    for module in (model.up, model.down, model.lm_head):
        assert isinstance(module.kernel_weight, F32MatmulWeight) == f32_kernel_built
        assert (module.packed_weight is not None) == (not f32_kernel_built)
    assert model.embed.weight is model.lm_head.weight is not None  # the embedding reads it
    assert pack_linears(model) == 0  # packing twice does nothing


@needs_onednn
def test_bf16_model_gets_a_float32_lm_head_and_bf16_linears_only_where_onednn_runs_them():
    model = TinyTiedModel(torch.bfloat16)
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_pack(model.up.weight) == bf16_native
    pack_linears(model)
    # the bf16 kernel where this CPU has AVX512_BF16 (tests/kernels/test_cpu_bf16_matmul.py), else
    # float32 on the float32 kernel or oneDNN
    assert (model.lm_head.kernel_weight is None) == (model.lm_head.packed_weight is not None)
    x = torch.randn(3, 16).to(torch.bfloat16)
    expected = x.float() @ model.lm_head.weight.float().T
    torch.testing.assert_close(model.lm_head.compute_logits(x), expected, atol=1e-4, rtol=1e-5)
    assert model.up.is_packed == bf16_native
    assert model.up(x).dtype == torch.bfloat16


@needs_onednn
def test_packing_follows_the_capabilities_it_is_given():
    """oneDNN where the capabilities have no kernel, even where this CPU builds one; nothing
    where they have no oneDNN either; an error where they name a kernel that is not built."""
    model = TinyTiedModel()
    assert model.up.pack(False, CPUS["plain-c"])
    assert model.up.packed_weight is not None and model.up.kernel_weight is None
    assert not model.down.pack(False, CPUS["no-kernels-no-onednn"])
    assert model.down.weight is not None and not model.down.is_packed
    cpu_kernel_loader.set_enabled(False)
    try:
        with pytest.raises(RuntimeError, match="f32_matmul.c was chosen .* not built"):
            model.down.pack(False, CPUS["avx2"])
    finally:
        cpu_kernel_loader.set_enabled(True)


def test_disabled_kernels_leave_every_weight_to_onednn():
    """With --enforce-eager (kernels off) this machine reads as one without the project's
    kernels, and their weights do not pack."""
    cpu_kernel_loader.set_enabled(False)
    try:
        capabilities = CpuLinearCapabilities.read()
        assert F32MatmulWeight.pack(torch.randn(64, 8)) is None
        assert Bf16MatmulWeight.pack(torch.randn(64, 8).bfloat16()) is None
    finally:
        cpu_kernel_loader.set_enabled(True)
    assert not capabilities.has_bf16_matmul and not capabilities.has_f32_matmul


@needs_onednn
def test_non_cpu_and_non_float_weights_are_not_packed():
    assert not can_pack(torch.zeros(4, 4, dtype=torch.int8))
    assert not can_pack(torch.zeros(4, 4, device="meta"))
    assert not can_pack(torch.zeros(4))
