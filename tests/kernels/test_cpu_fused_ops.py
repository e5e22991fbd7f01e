"""The fused elementwise C kernels of the CPU worker against float64 references and the torch
ops of `worker/model_executor/layers.py` they replace.

Each kernel computes in float32 and rounds a bf16 result once, so in float32 it agrees with a
float64 reference to float32 rounding, and in bf16 to one bf16 rounding step of the output.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from core_engine.kernels.cpu import fused_ops as cpu_fused_ops
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.worker.model_executor.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    apply_rotary,
    apply_rotary_qk,
)

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler on this machine: the CPU worker runs torch ops only here",
)

DTYPES = (torch.float32, torch.bfloat16)
# float32: a few ulps of values up to ~10; bf16: one rounding step (2^-8 relative) of the output.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=RTOL[dtype], atol=ATOL[dtype]
    )


@pytest.fixture
def kernels_enabled():
    cpu_kernel_loader.set_enabled(True)
    assert cpu_kernel_loader.load() is not None
    yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (33, 100), (130, 576)])  # the last one threaded
@pytest.mark.parametrize("num_threads", [1, 2])
def test_fused_add_rms_norm_matches_float64(kernels_enabled, dtype, shape, num_threads):
    generator = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=generator).to(dtype)
    residual = torch.randn(shape, generator=generator) * 3
    weight = (torch.rand(shape[1], generator=generator) + 0.5).to(dtype)
    summed = residual.double() + x.double()
    expected = weight.double() * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = cpu_fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    finally:
        torch.set_num_threads(previous)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(residual.double(), summed, rtol=1e-6, atol=1e-6)
    assert_close_to(out, expected, dtype)


def test_fused_add_rms_norm_refuses_mismatched_dtypes(kernels_enabled):
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="float32 residual"):
        cpu_fused_ops.fused_add_rms_norm(x, torch.randn(2, 16).bfloat16(), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused_ops.fused_add_rms_norm(x, torch.randn(16, 2).t(), torch.ones(16), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer_fuses_and_matches_torch_ops(kernels_enabled, dtype):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = (torch.rand(64) + 0.5).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    residual = torch.randn(5, 64)
    assert norm._fuses(x, residual)
    expected_residual = residual + x.float()
    expected = norm._normalize(expected_residual)
    out, new_residual = norm(x, residual.clone())
    torch.testing.assert_close(new_residual, expected_residual)
    assert_close_to(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("tokens", [9, 200])  # 200 tokens of q run threaded
def test_rotary_in_place_on_a_fused_qkv_view_matches_float64(
    kernels_enabled, dtype, head_dim, tokens
):
    """q and k are views at the start of a qkv row; v after them must stay untouched."""
    q_heads, kv_heads = 6, 2
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    positions = torch.randint(0, 5000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin = rotary(positions)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width).to(dtype)
    original = qkv.clone()
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(
        tokens, kv_heads, head_dim
    )
    for x, heads in ((q, q_heads), (k, kv_heads)):
        x64 = x.double()
        half = head_dim // 2
        c, s = cos.double()[:, None, :], sin.double()[:, None, :]
        expected = torch.cat(
            (x64[..., :half] * c - x64[..., half:] * s, x64[..., half:] * c + x64[..., :half] * s),
            dim=-1,
        )
        out = apply_rotary(x, cos, sin)
        assert out.data_ptr() == x.data_ptr(), "the kernel rotates in place"
        assert out.shape == (tokens, heads, head_dim)
        assert_close_to(out, expected, dtype)
    v_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], original[:, v_start:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_q_and_k_in_one_call_matches_two(kernels_enabled, dtype):
    """q and k side by side in a qkv row take one call; q and k of their own take two."""
    tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 64
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None)(torch.arange(tokens) * 7)
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(dtype)
    original = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(tokens, q_heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(qkv[:, q_size + kv_size :], original[:, q_size + kv_size :])
    # separate tensors: two calls; rotating back by the opposite angles restores q and k
    back_q, back_k = apply_rotary_qk(out_q.clone(), out_k.clone(), cos, -sin)
    round_trip_atol = 2**-5 if dtype == torch.bfloat16 else 1e-5  # two bf16 roundings of |x| < 8
    for back, start, heads in ((back_q, 0, q_heads), (back_k, q_size, kv_heads)):
        before = original[:, start : start + heads * head_dim].view(tokens, heads, head_dim)
        torch.testing.assert_close(back.float(), before.float(), atol=round_trip_atol, rtol=0)


def test_rotary_refuses_bad_angles_and_strides(kernels_enabled):
    x = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="angles must be"):
        cpu_fused_ops.rotary_embedding_neox_(x, torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused_ops.rotary_embedding_neox_(
            x.transpose(1, 2), torch.zeros(3, 1), torch.zeros(3, 1)
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (4, 100), (50, 3072)])
def test_silu_and_mul_matches_float64(kernels_enabled, dtype, shape):
    x = (torch.randn(shape) * 4).to(dtype)
    x[0, 0] = -100.0  # exp of a large argument must not overflow
    x[-1, 1] = 90.0
    width = shape[1] // 2
    expected = F.silu(x[:, :width].double()) * x[:, width:].double()
    out = SiluAndMul()(x)
    assert out.dtype == dtype and out.shape == (shape[0], width)
    assert_close_to(out, expected, dtype)


def test_nan_propagates_through_every_kernel(kernels_enabled):
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    assert torch.isnan(cpu_fused_ops.silu_and_mul(x)[1]).any()
    out = cpu_fused_ops.fused_add_rms_norm(x, torch.zeros(2, 32), torch.ones(32), 1e-5)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    bf16 = x.bfloat16().view(2, 1, 32)
    cpu_fused_ops.rotary_embedding_neox_(bf16, torch.ones(2, 16), torch.zeros(2, 16))
    assert torch.isnan(bf16[1].float()).any() and not torch.isnan(bf16[0].float()).any()


def test_disabled_kernels_fall_back_to_torch_ops():
    x = torch.randn(3, 64)
    cpu_kernel_loader.set_enabled(False)
    try:
        assert not cpu_fused_ops.supports(x)
        out = SiluAndMul()(x)
    finally:
        cpu_kernel_loader.set_enabled(True)
    torch.testing.assert_close(out, F.silu(x[:, :32]) * x[:, 32:])
    assert cpu_fused_ops.supports(x)
    assert not cpu_fused_ops.supports(x.half())
