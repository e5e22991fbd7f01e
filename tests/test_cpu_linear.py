"""Packed CPU linears (oneDNN, or the project's float32/bf16 kernels where they are built): same
results as F.linear, one weight copy kept, tied weights kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_kernel_loader
from kernels.cpu_f32_matmul import F32MatmulWeight
from worker.cpu_linear import can_pack, pack_linears
from worker.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


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


def f32_kernel_built() -> bool:
    library = cpu_kernel_loader.load()
    return library is not None and library.f32_matmul_panel_columns() > 0


def test_packing_keeps_one_copy_except_for_tied_weights():
    model = TinyTiedModel()
    pack_linears(model)
    assert model.up.weight is None and model.down.weight is None
    assert model.up.is_packed and model.up.bias is not None
    # float32 weights: the project's kernel where it is built (AVX2 without AVX-512), else oneDNN
    for module in (model.up, model.down, model.lm_head):
        assert isinstance(module.kernel_weight, F32MatmulWeight) == f32_kernel_built()
        assert (module.packed_weight is not None) == (not f32_kernel_built())
    assert model.embed.weight is model.lm_head.weight is not None  # the embedding reads it
    assert pack_linears(model) == 0  # packing twice does nothing


def test_bf16_model_gets_a_float32_lm_head_and_bf16_linears_only_where_onednn_runs_them():
    model = TinyTiedModel(torch.bfloat16)
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_pack(model.up.weight) == bf16_native
    pack_linears(model)
    # the bf16 kernel where this CPU has AVX512_BF16 (tests/test_cpu_bf16_matmul.py), else
    # float32 on the float32 kernel or oneDNN
    assert (model.lm_head.kernel_weight is None) == (model.lm_head.packed_weight is not None)
    x = torch.randn(3, 16).to(torch.bfloat16)
    expected = x.float() @ model.lm_head.weight.float().T
    torch.testing.assert_close(model.lm_head.compute_logits(x), expected, atol=1e-4, rtol=1e-5)
    assert model.up.is_packed == bf16_native
    assert model.up(x).dtype == torch.bfloat16


def test_non_cpu_and_non_float_weights_are_not_packed():
    assert not can_pack(torch.zeros(4, 4, dtype=torch.int8))
    assert not can_pack(torch.zeros(4, 4, device="meta"))
    assert not can_pack(torch.zeros(4))
