"""The float32 matmul kernel of the CPU worker (AVX2 + FMA, float32 linears and LM head)
against float64.

The kernel sums float32 products in float32, one k after another per output: its error
against a float64 matmul of the same operands is float32 summation error, at most about
k * 2^-24 of the sum of |products| (the bound below, with room to spare, is 1e-6 of it).
On a CPU whose default build does not hold the kernel (AVX-512), the AVX2 build is compiled
here with `-mno-avx512f` and tested instead; on a CPU without AVX2/FMA the tests skip, listed
at the end of the run as kernel tests this host skipped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from core_engine.kernels.cpu import fused_ops as cpu_fused_ops
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.worker.model_executor.cpu_linear import pack_linears
from core_engine.worker.model_executor.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
)
from core_engine.worker.model_executor.model_config import ModelConfig
from core_engine.worker.model_executor.models.llama import LlamaMLP
from tests.helpers.cpu_kernel_builds import (
    AVX2,
    assert_float32_sums,
    kernel_library,
    requires_cpu_flags,
)

pytestmark = requires_cpu_flags(*AVX2.cpu_flags, kernel="f32_matmul.c")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return kernel_library(AVX2, tmp_path_factory)


@pytest.fixture
def kernel(library, monkeypatch):
    """Makes `cpu_kernel_loader.load` return the library under test."""
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: library)
    assert library.f32_matmul_panel_columns() == 16
    return library


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def with_threads(num_threads: int, function):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return function()
    finally:
        torch.set_num_threads(previous)


# Rows 1..13 cover every row tail of the 6-row tiles; 20, 40 and 70 columns end inside a panel
# (in its first or second half), 1 panel and several; k from 1 to the default model's widest.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize(("columns", "k"), [(16, 1), (20, 576), (40, 3), (70, 1536), (128, 64)])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_output_matches_float64_for_every_tail(kernel, rows, columns, k, num_threads):
    weight, x = randn(columns, k, seed=columns), randn(rows, k, seed=rows)
    packed = F32MatmulWeight.pack(weight)
    assert packed is not None and packed.packed.shape == ((columns + 15) // 16, k, 16)
    out = with_threads(num_threads, lambda: packed.matmul(x))
    assert out.is_contiguous()
    assert_float32_sums(out, x, weight)


@pytest.mark.parametrize("columns", [16, 27, 100])
def test_bias_is_added_to_real_columns_only(kernel, columns):
    weight, bias, x = randn(columns, 48, seed=1), randn(columns, seed=2), randn(2, 3, 48, seed=3)
    out = F32MatmulWeight.pack(weight).matmul(x, bias)
    assert out.shape == (2, 3, columns)
    assert_float32_sums(out.view(6, columns), x.view(6, 48), weight, bias)


def test_many_rows_and_a_strided_input(kernel):
    """A prompt-sized batch, and x as every other row of a wider tensor (a view the kernel
    reads in place): both equal the float64 product."""
    weight = randn(96, 64, seed=4)
    packed = F32MatmulWeight.pack(weight)
    x = randn(1030, 64, seed=5)
    assert_float32_sums(packed.matmul(x), x, weight)
    wide = randn(40, 128, seed=6)
    view = wide[::2, 32:96]
    assert view.stride() == (256, 1)
    assert_float32_sums(packed.matmul(view), view, weight)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_rows_past_one_row_block(kernel, num_threads):
    """At k = 1536 a row block is 5 tiles (30 rows, 184 KiB of x): 97 rows go through as four
    blocks and a part block, each through every panel of a thread's run; every row equals
    the float64 product, and the blocked sums are the same bits as one row at a time."""
    weight, bias, x = randn(70, 1536, seed=10), randn(70, seed=11), randn(97, 1536, seed=12)
    packed = F32MatmulWeight.pack(weight)
    out = with_threads(num_threads, lambda: packed.matmul(x, bias))
    assert_float32_sums(out, x, weight, bias)
    one_row_at_a_time = torch.cat([packed.matmul(x[r : r + 1], bias) for r in range(97)])
    assert torch.equal(out, one_row_at_a_time)


def test_threads_sharing_their_runs_under_contention_compute_every_output_once(kernel):
    """Two threads split the units and the first done takes the rest of the other's run: with
    a busy process competing for a core the split moves from call to call, and every call
    still equals the one-thread product bit for bit (no unit lost: the output is uninitialized
    memory; none computed twice differently: each is one tile's k-ordered sum)."""
    weight, x = randn(1024, 1536, seed=14), randn(197, 1536, seed=15)
    packed = F32MatmulWeight.pack(weight)
    expected = with_threads(1, lambda: packed.matmul(x))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(20):
            assert torch.equal(with_threads(2, lambda: packed.matmul(x)), expected)
            gated = with_threads(2, lambda: packed.matmul_silu_and_mul(x[:37]))
            assert torch.equal(gated, cpu_fused_ops.silu_and_mul(expected[:37]))
    finally:
        busy.kill()
        busy.wait()


def test_padding_columns_are_never_stored(kernel):
    """The output has exactly num_columns columns; the next row's first columns, which a
    store of a whole padded panel would overwrite, keep the right values."""
    weight = randn(17, 8, seed=7)
    x = randn(7, 8, seed=8)
    out = F32MatmulWeight.pack(weight).matmul(x)
    assert out.shape == (7, 17)
    assert_float32_sums(out, x, weight)


def test_empty_batch(kernel):
    out = F32MatmulWeight.pack(randn(32, 8, seed=9)).matmul(torch.empty(0, 8))
    assert out.shape == (0, 32)


def test_what_the_kernel_cannot_take_is_refused(kernel):
    assert F32MatmulWeight.pack(randn(64, 8, seed=0).bfloat16()) is None
    assert F32MatmulWeight.pack(randn(64, seed=0)) is None  # not a matrix
    packed = F32MatmulWeight.pack(randn(64, 8, seed=0))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        packed.matmul(randn(2, 6, seed=1))
    with pytest.raises(ValueError, match="bfloat16"):
        packed.matmul(randn(2, 8, seed=1), out_dtype=torch.bfloat16)


def test_float32_linears_and_lm_head_run_on_the_kernel(kernel):
    up = ColumnParallelLinear(40, 72, bias=True)
    down = RowParallelLinear(72, 40)
    head = ParallelLMHead(100, 40)
    for module, seed in ((up, 10), (down, 11), (head, 12)):
        for param in module.parameters():
            param.data = randn(*param.shape, seed=seed)
    modules = {"up": up, "down": down, "head": head}
    dense = {name: module.weight.detach().clone() for name, module in modules.items()}
    bias = up.bias.detach().clone()
    assert sum(pack_linears(module) for module in (up, down, head)) == 3
    for module in (up, down, head):
        assert isinstance(module.kernel_weight, F32MatmulWeight)
        assert module.weight is None and module.packed_weight is None
    x = randn(11, 40, seed=13)
    hidden = up(x)
    assert_float32_sums(hidden, x, dense["up"], bias)
    assert_float32_sums(down(hidden), hidden, dense["down"])
    logits = head.compute_logits(x)
    assert logits.shape == (11, 100)
    assert_float32_sums(logits, x, dense["head"])
    torch.testing.assert_close(logits, F.linear(x, dense["head"]), atol=1e-4, rtol=1e-5)


# The fused gated MLP: gate_up's matmul and SiLU-and-mul in one kernel pass. Width 16 is one
# (gate, up) pair (fewer pairs than 2 or 3 threads), 48 three; k = 1536 at 97 rows crosses
# row blocks.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 97])
@pytest.mark.parametrize(("width", "k"), [(16, 8), (48, 576), (32, 1536)])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_and_mul_is_the_same_bits_as_matmul_then_silu_and_mul(
    kernel, rows, width, k, num_threads, with_bias
):
    weight, x = randn(2 * width, k, seed=width), randn(rows, k, seed=rows)
    bias = randn(2 * width, seed=k) if with_bias else None
    packed = F32MatmulWeight.pack(weight)
    assert packed.splits_into_gate_and_up
    fused = with_threads(num_threads, lambda: packed.matmul_silu_and_mul(x, bias))
    assert fused.shape == (rows, width) and fused.is_contiguous()
    two_passes = with_threads(
        num_threads, lambda: cpu_fused_ops.silu_and_mul(packed.matmul(x, bias))
    )
    assert torch.equal(fused, two_passes)
    gate_up = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]  # gate first, then up
    torch.testing.assert_close(fused.double(), expected, atol=1e-3, rtol=1e-3)


def test_fused_silu_and_mul_keeps_leading_dimensions_and_reads_a_strided_input(kernel):
    weight = randn(64, 40, seed=20)
    packed = F32MatmulWeight.pack(weight)
    x = randn(2, 3, 40, seed=21)
    out = packed.matmul_silu_and_mul(x)
    assert out.shape == (2, 3, 32)
    assert torch.equal(out.view(6, 32), packed.matmul_silu_and_mul(x.view(6, 40)))
    wide = randn(9, 80, seed=22)
    view = wide[:, 20:60]
    assert torch.equal(
        packed.matmul_silu_and_mul(view), packed.matmul_silu_and_mul(view.contiguous())
    )


def test_fused_silu_and_mul_refuses_halves_inside_a_panel(kernel):
    """Halves of 24 columns meet inside the second panel: the kernel cannot pair whole gate
    and up panels, so it refuses, naming the columns, and MergedColumnParallelLinear falls
    back to matmul then SiLU-and-mul."""
    packed = F32MatmulWeight.pack(randn(48, 8, seed=23))
    assert not packed.splits_into_gate_and_up
    with pytest.raises(ValueError, match="48 columns"):
        packed.matmul_silu_and_mul(randn(2, 8, seed=24))
    gate_up = MergedColumnParallelLinear(8, [24, 24])
    gate_up.weight.data = randn(48, 8, seed=23)
    assert pack_linears(gate_up) == 1 and not gate_up.fuses_silu_and_mul
    x = randn(5, 8, seed=25)
    assert torch.equal(gate_up.silu_and_mul(x), cpu_fused_ops.silu_and_mul(gate_up(x)))


def test_gate_up_projection_fuses_silu_and_mul_on_the_kernel(kernel):
    """A packed gate_up pair of 32 + 32 columns computes silu(gate) * up in the kernel: the
    same bits as its matmul followed by SiLU-and-mul, and the float64 value."""
    gate_up = MergedColumnParallelLinear(40, [32, 32])
    gate_up.weight.data = randn(64, 40, seed=26)
    dense = gate_up.weight.detach().clone()
    assert not gate_up.fuses_silu_and_mul  # not packed yet: no kernel weight
    assert pack_linears(gate_up) == 1 and gate_up.fuses_silu_and_mul
    x = randn(11, 40, seed=27)
    out = gate_up.silu_and_mul(x)
    assert torch.equal(out, cpu_fused_ops.silu_and_mul(gate_up(x)))
    hidden = x.double() @ dense.double().T
    expected = F.silu(hidden[:, :32]) * hidden[:, 32:]
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def mlp_config(hidden_act: str) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=40,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=20,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        bos_token_id=None,
        eos_token_ids=(0,),
        torch_dtype="float32",
        hidden_act=hidden_act,
    )


class CountingLibrary:
    """The kernel library, counting calls of the fused gated-MLP entry point."""

    def __init__(self, library) -> None:
        self.library, self.fused_calls = library, 0

    def __getattr__(self, name):
        if name == "f32_matmul_silu_and_mul":
            self.fused_calls += 1
        return getattr(self.library, name)


@pytest.mark.parametrize(("hidden_act", "fused_calls"), [("silu", 1), ("gelu_pytorch_tanh", 0)])
def test_llama_mlp_runs_silu_in_the_gate_up_kernel(library, monkeypatch, hidden_act, fused_calls):
    """A SiLU MLP on the float32 kernel takes the fused path (one kernel call, no
    [tokens, 2 * I] intermediate) and outputs what the unfused layers would; a GeGLU MLP keeps
    matmul, activation, matmul."""
    counting = CountingLibrary(library)
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: counting)
    mlp = LlamaMLP(mlp_config(hidden_act), tp_rank=0, tp_size=1)
    for seed, param in enumerate(mlp.parameters()):
        param.data = randn(*param.shape, seed=30 + seed)
    x = randn(7, 40, seed=40)
    unpacked = mlp(x)
    assert pack_linears(mlp) == 2
    counting.fused_calls = 0
    out = mlp(x)
    assert counting.fused_calls == fused_calls
    unfused = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
    assert torch.equal(out, unfused)
    torch.testing.assert_close(out, unpacked, atol=1e-4, rtol=1e-4)
