"""The batched LoRA shrink+expand CUDA kernels (`kernels/cuda/lora_shrink_expand.cu`) through
their launcher: in the CPU emulator (tests/helpers/cuda_cpu_emulator.py, every launch's argument
packing checked against the kernel's parameters, warps in a random order), and on a GPU where
there is one (`gpu`). Both against the float64 reference within the float32 summation bound
plus one rounding of a bf16 / fp16 y (tests/helpers/lora_shrink_expand_cases.py); rows of
tokens without an adapter stay bit for bit. nvcc, NVRTC and ptxas checks of the source are in
test_kernel_sources.py and test_kernel_resources.py with every other kernel's."""

from __future__ import annotations

import re

import pytest
import torch

from core_engine.kernels.cuda import lora_launch
from core_engine.kernels.cuda import lora_shrink_expand as cuda_lora
from core_engine.kernels.cuda.backend import is_available as cuda_is_available
from core_engine.kernels.cuda.module_loader import KERNEL_DIR
from core_engine.kernels.lora_operands import LoRAOperandError
from tests.helpers.cuda_cpu_emulator import EmulatedLoader, compiler_available, launch_on_cpu
from tests.helpers.lora_shrink_expand_cases import (
    LoRACase,
    assert_matches_reference,
    make_case,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_gpp = pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")


@pytest.fixture
def loader(monkeypatch) -> EmulatedLoader:
    """The launcher unchanged but for its seams: kernels compiled for the CPU emulator,
    launched without CuPy, on CPU tensors."""
    emulated = EmulatedLoader()
    monkeypatch.setattr(cuda_lora, "default_loader", lambda: emulated)
    monkeypatch.setattr(cuda_lora, "_launch", launch_on_cpu)
    monkeypatch.setattr(cuda_lora, "_DEVICE_TYPE", "cpu")
    return emulated


def run(case: LoRACase) -> LoRACase:
    result = case.clone()
    cuda_lora.lora_shrink_expand(*result.operands)
    if result.y.is_cuda:
        torch.cuda.synchronize()
    assert_matches_reference(result, case)
    return result


def launched(loader: EmulatedLoader) -> set[str]:
    return {name for (_, name), kernel in loader.kernels.items() if kernel.num_launches}


@pytest.mark.parametrize(
    ("source_constant", "value"),
    [
        ("kLoraShrinkWarps", lora_launch.SHRINK_WARPS),
        ("kLoraShrinkRows", lora_launch.SHRINK_ROWS),
        ("kLoraShrinkTokens", lora_launch.SHRINK_TOKENS),
        ("kLoraExpandThreads", lora_launch.EXPAND_THREADS),
        ("kLoraExpandTokens", lora_launch.EXPAND_TOKENS),
    ],
)
def test_launch_constants_match_the_kernel(source_constant, value):
    text = (KERNEL_DIR / lora_launch.SOURCE_NAME).read_text()
    match = re.search(rf"constexpr int {source_constant} = (\d+);", text)
    assert match, f"{source_constant} not found in {lora_launch.SOURCE_NAME}"
    assert int(match.group(1)) == value


def test_launch_shapes():
    launch = lora_launch.LoRALaunch.of(
        num_tokens=9, width=33, out_features=129, element_bytes=2, b_address=0
    )
    assert launch.shrink_grid == (3, 3, 1) and launch.shrink_block == (128, 1, 1)
    assert launch.expand_grid == (3, 2, 1) and launch.expand_block == (128, 1, 1)
    assert not launch.vector_rows  # 33 bf16 = 66 bytes a row
    assert lora_launch.LoRALaunch.of(1, 16, 1, 2, 256).vector_rows
    assert not lora_launch.LoRALaunch.of(1, 16, 1, 2, 258).vector_rows
    assert lora_launch.LoRALaunch.of(1, 4, 1, 4, 0).vector_rows
    with pytest.raises(ValueError, match="65535"):
        lora_launch.LoRALaunch.of(1, 16, 65536 * 128, 4, 0)


@needs_gpp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "out_features", "width", "num_slots", "slots"),
    [
        pytest.param(1, 576, 960, 48, 1, "all", id="one-token-vector-rows"),
        pytest.param(2, 100, 101, 13, 3, [2, -1], id="odd-sizes"),
        pytest.param(7, 960, 136, 8, 4, "alternating", id="decode-rank-8"),
        pytest.param(33, 72, 130, 20, 2, "random", id="width-20"),
        pytest.param(300, 40, 72, 16, 4, "runs", id="runs-300"),
        pytest.param(300, 24, 40, 7, 3, "alternating", id="alternating-300"),
        pytest.param(5, 3, 5, 1, 2, "none", id="no-adapter"),
    ],
)
def test_emulated_matches_float64(
    loader, dtype, num_tokens, in_features, out_features, width, num_slots, slots
):
    run(make_case(num_tokens, in_features, out_features, width, num_slots, dtype, slots))
    name = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "half_t"}[dtype]
    assert launched(loader) == {f"lora_shrink<{name}>", f"lora_expand<{name}>"}


@needs_gpp
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 17])
def test_emulated_token_tiles_and_row_groups(loader, num_tokens):
    """Token tiles of 4, shrink row groups of 16 (4 warps x 4 rows), column blocks of 128:
    sizes on and off each, bf16 rows of 34 bytes (element by element)."""
    run(make_case(num_tokens, 33, 129, 17, 2, torch.bfloat16, "random", seed=num_tokens))


@needs_gpp
def test_emulated_slots_out_of_range_are_skipped(loader):
    """The launcher cannot check slots without a device sync: the kernels skip any slot outside
    [0, S) as they skip -1, and never read past lora_a / lora_b."""
    case = make_case(4, 16, 24, 8, 2, torch.float32, [0, 2, -5, 1])
    result = case.clone()
    cuda_lora.lora_shrink_expand(*result.operands)
    assert torch.equal(result.y[1:3], case.y[1:3])
    in_range = make_case(4, 16, 24, 8, 2, torch.float32, [0, -1, -1, 1])
    assert_matches_reference(result, in_range)


@needs_gpp
def test_emulated_empty_batch_launches_nothing(loader):
    cuda_lora.lora_shrink_expand(*make_case(0, 16, 16, 8, 2, torch.float32).operands)
    assert launched(loader) == set()


def test_operands_are_checked_before_any_launch(monkeypatch):
    monkeypatch.setattr(cuda_lora, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cuda_lora, "default_loader", lambda: pytest.fail("launched"))
    x, y, lora_a, lora_b, slots = make_case(4, 16, 24, 8, 2, torch.float32).operands
    with pytest.raises(LoRAOperandError, match="lora_b: shape") as raised:
        cuda_lora.lora_shrink_expand(x, y, lora_a, lora_b[:, :, :4].contiguous(), slots)
    assert raised.value.argument == "lora_b"
    with pytest.raises(LoRAOperandError, match="x: dtype"):
        cuda_lora.lora_shrink_expand(x.double(), y, lora_a, lora_b, slots)


def test_cpu_tensors_are_refused_by_the_cuda_launcher():
    with pytest.raises(LoRAOperandError, match="x: must be on cuda"):
        cuda_lora.lora_shrink_expand(*make_case(2, 8, 8, 4, 1, torch.float32).operands)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_is_available(), reason="needs CUDA and CuPy")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "slots"), [(1, "all"), (64, "alternating"), (2048, "runs"), (300, "random")]
)
def test_gpu_matches_float64(dtype, num_tokens, slots):
    for width in (16, 13):  # 16-byte rows of B, and rows read element by element
        case = make_case(num_tokens, 1536, 960, width, 4, dtype, slots, device="cuda")
        run(case)
