"""The batched LoRA shrink+expand C kernel (`kernels/cpu/lora_shrink_expand.c`) on every kernel
build this host runs (plain C, AVX2 + FMA, AVX-512), against a float64 reference within the
float32 summation bound, plus one rounding of a bf16 y (tests/helpers/lora_shrink_expand_cases.py
derives both); rows of tokens without an adapter stay bit for bit; threads change no bit; a bad
operand is refused with an error that names it, before y is touched."""

from __future__ import annotations

import pytest
import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu import lora_shrink_expand as cpu_lora
from core_engine.kernels.lora_operands import LoRAOperandError
from tests.helpers.cpu_kernel_builds import (
    kernel_library_fixtures,
)
from tests.helpers.lora_shrink_expand_cases import (
    LoRACase,
    assert_matches_reference,
    make_case,
)

DTYPES = (torch.float32, torch.bfloat16)
build, kernel = kernel_library_fixtures("lora_shrink_expand.c")


def run(case: LoRACase, num_threads: int = 1) -> LoRACase:
    """The kernel on a copy of `case` with `num_threads` threads; asserts it matches."""
    result = case.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        cpu_lora.lora_shrink_expand(*result.operands)
    finally:
        torch.set_num_threads(previous)
    assert_matches_reference(result, case)
    return result


def test_each_build_reports_its_vector_width(kernel, build):
    assert cpu_lora.vector_floats() == build.attention.vector_floats


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "out_features", "width", "num_slots", "slots"),
    [
        pytest.param(1, 576, 960, 48, 1, "all", id="one-token"),
        pytest.param(1, 576, 960, 48, 2, "none", id="one-token-no-adapter"),
        pytest.param(2, 100, 101, 13, 3, [2, -1], id="odd-sizes"),
        pytest.param(7, 960, 1536, 8, 4, "alternating", id="decode-rank-8"),
        pytest.param(64, 576, 576, 24, 4, "alternating", id="decode-64"),
        pytest.param(33, 1536, 576, 100, 2, "random", id="width-100"),
        pytest.param(5, 40, 70, 600, 2, "random", id="width-600"),  # expand rows in chunks
        pytest.param(300, 576, 1536, 16, 4, "runs", id="runs-300"),
        pytest.param(300, 100, 960, 7, 3, "alternating", id="alternating-300"),
        pytest.param(17, 3, 5, 1, 1, "random", id="tiny"),
    ],
)
def test_matches_float64(
    kernel, dtype, num_tokens, in_features, out_features, width, num_slots, slots
):
    run(make_case(num_tokens, in_features, out_features, width, num_slots, dtype, slots))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 15, 16, 17, 31, 33, 100, 257])
@pytest.mark.parametrize("slots", ["runs", "alternating", "random"])
def test_token_counts_around_tiles(kernel, dtype, num_tokens, slots):
    """Tiles hold 16 tokens of one slot, shrink units 16 rows, expand units 64 columns, row
    groups 8: sizes on and off each."""
    run(make_case(num_tokens, 72, 130, 20, 3, dtype, slots, seed=num_tokens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threads_change_no_bit(kernel, dtype):
    """Every output is one unit's sum whichever thread computes it (the call is large enough
    to run threaded)."""
    case = make_case(200, 576, 960, 32, 4, dtype, "runs", seed=3)
    one = run(case, num_threads=1)
    two = run(case, num_threads=2)
    assert torch.equal(one.y, two.y)


def test_matches_the_torch_path_of_linear_lora(kernel):
    """The kernel adds what `LinearLoRA.add_to` (the engine's torch path) adds."""
    from core_engine.worker.lora.linear_lora import LinearLoRA, LoRASlice
    from core_engine.worker.lora.lora_step import LoRAStep

    step = LoRAStep(torch.device("cpu"))
    linear = LinearLoRA(
        step, [LoRASlice("q", slice(0, 64), 0), LoRASlice("v", slice(0, 32), 64)],
        in_features=96, out_features=96, max_rank=8, num_slots=3, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    linear.lora_a.copy_(torch.randn(linear.lora_a.shape, generator=generator) / 96**0.5)
    linear.lora_b.copy_(torch.randn(linear.lora_b.shape, generator=generator) / 16**0.5)
    row_slots, tokens_per_row = [2, -1, 0, 2], [5, 3, 1, 1]
    step.set_token_slots(row_slots, torch.tensor(tokens_per_row).numpy())
    x = torch.randn(10, 96, generator=generator)
    y = torch.randn(10, 96, generator=generator)
    expected = y.clone()
    linear.add_to(x, expected)
    token_slots = torch.tensor(row_slots, dtype=torch.int32).repeat_interleave(
        torch.tensor(tokens_per_row)
    )
    cpu_lora.lora_shrink_expand(x, y, linear.lora_a, linear.lora_b, token_slots)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_empty_batch_and_zero_width(kernel):
    case = make_case(0, 16, 16, 8, 2, torch.float32)
    cpu_lora.lora_shrink_expand(*case.operands)
    case = make_case(5, 16, 16, 0, 2, torch.float32, "all")
    before = case.y.clone()
    cpu_lora.lora_shrink_expand(*case.operands)
    assert torch.equal(case.y, before)


def _bad_operands(name: str) -> tuple[tuple[torch.Tensor, ...], str]:
    """Operands of a 4-token call with `name` made bad in one way, and the message's gist."""
    x, y, lora_a, lora_b, slots = make_case(4, 16, 24, 8, 2, torch.float32, "random").operands
    return {
        "x-strided": ((torch.randn(16, 4).t(), y, lora_a, lora_b, slots), "x: must be contiguous"),
        "x-float64": ((x.double(), y, lora_a, lora_b, slots), "x: dtype"),
        "x-rank": ((x[None], y, lora_a, lora_b, slots), "x: must be"),
        "y-dtype": ((x, y.bfloat16(), lora_a, lora_b, slots), "y: dtype"),
        "y-rows": ((x, y[:3].contiguous(), lora_a, lora_b, slots), "y: shape"),
        "lora_a-in": ((x, y, lora_a[:, :, :15].contiguous(), lora_b, slots), "lora_a: shape"),
        "lora_b-width": ((x, y, lora_a, lora_b[:, :, :7].contiguous(), slots), "lora_b: shape"),
        "lora_b-slots": ((x, y, lora_a, lora_b[:1].contiguous(), slots), "lora_b: shape"),
        "token_slots-int64": ((x, y, lora_a, lora_b, slots.long()), "token_slots: dtype"),
        "token_slots-length": (
            (x, y, lora_a, lora_b, slots[:3].contiguous()),
            "token_slots: shape",
        ),
        "token_slots-too-big": (
            (x, y, lora_a, lora_b, torch.tensor([0, 2, -1, 1], dtype=torch.int32)),
            r"token_slots: slot 2 is outside \[-1, 2\)",
        ),
        "token_slots-below-minus-one": (
            (x, y, lora_a, lora_b, torch.tensor([0, -2, 1, 1], dtype=torch.int32)),
            r"token_slots: slot -2",
        ),
    }[name]


@pytest.mark.parametrize(
    "case_id",
    [
        "x-strided", "x-float64", "x-rank", "y-dtype", "y-rows", "lora_a-in", "lora_b-width",
        "lora_b-slots", "token_slots-int64", "token_slots-length", "token_slots-too-big",
        "token_slots-below-minus-one",
    ],
)  # fmt: skip
def test_a_bad_operand_is_named_and_y_is_untouched(kernel, case_id):
    operands, message = _bad_operands(case_id)
    before = operands[1].clone()
    with pytest.raises(LoRAOperandError, match=message) as raised:
        cpu_lora.lora_shrink_expand(*operands)
    assert raised.value.argument == case_id.split("-")[0]
    assert torch.equal(operands[1], before)


def test_without_the_library_it_says_so(monkeypatch):
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: None)
    case = make_case(2, 8, 8, 4, 1, torch.float32, "all")
    assert cpu_lora.vector_floats() == 0
    assert not cpu_lora.supports(case.x, case.lora_a)
    with pytest.raises(RuntimeError, match="not built"):
        cpu_lora.lora_shrink_expand(*case.operands)


def test_supports_float32_and_bf16_cpu_tensors_only():
    if cpu_kernel_loader.load() is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    assert cpu_lora.supports(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_lora.supports(torch.zeros(2, dtype=torch.float16))
