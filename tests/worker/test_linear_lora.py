"""`LinearLoRA` and `LoRAStep` on their own: an adapter written into a slot (sliced for a
tensor-parallel rank, scaled, zero-padded past its rank) adds exactly B (A x) to each token's
rows, through the shrink/expand kernel and through torch alike, in float32 and bf16; tokens
without an adapter are untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.kernels.cpu import lora_shrink_expand as cpu_lora
from core_engine.worker.lora.linear_lora import LinearLoRA, LoRASlice
from core_engine.worker.lora.lora_step import NO_SLOT, LoRAStep

CPU = torch.device("cpu")
IN, MAX_RANK = 48, 8
rng = np.random.default_rng(0)


def adapter(rank: int, out: int, in_features: int = IN) -> tuple[np.ndarray, np.ndarray]:
    lora_a = rng.standard_normal((rank, in_features)).astype(np.float32)
    lora_b = rng.standard_normal((out, rank)).astype(np.float32)
    return lora_a, lora_b


def reference(x: torch.Tensor, pieces) -> torch.Tensor:
    """[T, out] float64: each (A, B, output rows) piece's B (A x) placed in its rows."""
    out = torch.zeros(x.shape[0], sum(b.shape[0] for _, b in pieces), dtype=torch.float64)
    first = 0
    for lora_a, lora_b in pieces:
        delta = (
            x.double() @ torch.from_numpy(lora_a).double().T @ torch.from_numpy(lora_b).double().T
        )
        out[:, first : first + lora_b.shape[0]] = delta
        first += lora_b.shape[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_fused_linear_adds_each_token_s_adapter_to_its_own_rows(dtype, use_kernel, monkeypatch):
    if use_kernel and not cpu_lora.supports(torch.zeros(1, dtype=dtype)):
        pytest.skip("the CPU kernels are not built here")
    if not use_kernel:
        monkeypatch.setattr(cpu_lora, "supports", lambda *tensors: False)
    step = LoRAStep(CPU)
    slices = [LoRASlice("q_proj", slice(None), 0), LoRASlice("k_proj", slice(None), 32)]
    linear = LinearLoRA(step, slices, IN, 48, MAX_RANK, num_slots=2, dtype=dtype, device=CPU)
    q0, k0 = adapter(4, 32), adapter(4, 16)
    q1 = adapter(8, 32)  # the second adapter targets q only: k rows get nothing
    linear.write_slot(0, {"q_proj": q0, "k_proj": k0})
    linear.write_slot(1, {"q_proj": q1})
    # Requests of 3, 1 and 2 tokens: slot 1, none, slot 0.
    step.set_token_slots([1, NO_SLOT, 0], np.array([3, 1, 2]))
    x = torch.randn(6, IN).to(dtype)
    y = torch.randn(6, 48).to(dtype)
    before = y.clone()
    linear.add_to(x, y)
    expected = before.double()
    expected[0:3] += reference(
        x[0:3], [q1, (np.zeros((8, IN), np.float32), np.zeros((16, 8), np.float32))]
    )
    expected[4:6] += reference(x[4:6], [q0, k0])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max()
    assert torch.equal(y[3], before[3])  # no adapter: untouched, bit for bit
    assert (y.double() - expected).abs().max() <= tolerance * scale


def test_a_rank_s_shards_are_the_unsharded_adapter_s_pieces():
    """Column-parallel rank 1 of 2 takes B's second half of rows; row-parallel takes A's
    second half of columns; the two ranks' row-parallel outputs sum to the whole."""
    step = LoRAStep(CPU)
    lora_a, lora_b = adapter(4, 64)
    column = LinearLoRA(step, [LoRASlice("up_proj", slice(32, 64), 0)], IN, 32, MAX_RANK, 1,
                        torch.float32, CPU)  # fmt: skip
    column.write_slot(0, {"up_proj": (lora_a, lora_b)})
    step.set_token_slots([0], np.array([5]))
    x = torch.randn(5, IN)
    y = torch.zeros(5, 32)
    column.add_to(x, y)
    whole = reference(x, [(lora_a, lora_b)])
    assert torch.allclose(y.double(), whole[:, 32:], rtol=1e-4, atol=1e-4)

    down_a, down_b = adapter(4, 16, in_features=64)
    total = torch.zeros(5, 16)
    x_full = torch.randn(5, 64)
    for rank in range(2):
        columns = slice(32 * rank, 32 * (rank + 1))
        row = LinearLoRA(step, [LoRASlice("down_proj", slice(None), 0)], 32, 16, MAX_RANK, 1,
                         torch.float32, CPU, input_columns=columns)  # fmt: skip
        row.write_slot(0, {"down_proj": (down_a, down_b)})
        row.add_to(x_full[:, columns].contiguous(), total)
    assert torch.allclose(
        total.double(), reference(x_full, [(down_a, down_b)]), rtol=1e-4, atol=1e-4
    )


def test_a_step_without_adapter_tokens_is_inactive_and_long_one_adapter_steps_use_matmul():
    step = LoRAStep(CPU)
    step.set_token_slots([NO_SLOT, NO_SLOT], np.array([3, 4]))
    assert not step.active and step.token_slots is None
    step.set_token_slots([2, 2], np.array([40, 40]))
    assert step.groups == [(2, None)] and step.runs_matmul(80)
    step.set_token_slots([2, NO_SLOT], np.array([40, 40]))
    assert not step.runs_matmul(80)
    assert step.token_slots.tolist() == [2] * 40 + [NO_SLOT] * 40
