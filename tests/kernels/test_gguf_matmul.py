"""The GGUF-block matmul of the CPU worker (`--quantization gguf`) on every kernel build this
host runs: each block type dequantizes to exactly the gguf package's values, and a matmul
equals the float64 product of those values up to float32 summation (the float column path:
K-quants at decode sizes, every call of the plain C build; panels for f32_matmul's
micro-kernel: prompt-sized K-quant calls on the AVX2 build), or up to float32
summation plus the rounding of x per 32-value block where the build reports such a path: to
16-bit integers on the integer path (Q4_0, Q4_1, Q8_0 up to its row limit), to 8-bit ones on
the byte path (the same types past that limit); with a bias, for weights of several segments of
different types, and for an embedding lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.kernels.cpu.gguf_matmul import (
    BLOCK_SHAPES,
    GGUF_MATMUL_TYPES,
    GgufMatmulWeight,
    GgufSegment,
)
from tests.helpers.cpu_kernel_builds import (
    assert_float32_sums,
    kernel_library_fixtures,
)

gguf = pytest.importorskip("gguf")

K = 512  # two K-quant blocks, sixteen 32-value blocks per row
BLOCK32_TYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: the integer path's
BYTE_TYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: the byte path's
build, kernel = kernel_library_fixtures("gguf_matmul.c")


def test_the_build_reports_whether_it_has_panels(build, kernel):
    assert kernel.gguf_matmul_has_panels() == int(build.gguf_matmul_panels)


def quantized_blocks(type_id: int, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] blocks of `type_id`: random weights quantized by the gguf
    package where it can (Q4_0, Q4_1, Q8_0), else random bytes with small float16 scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType(type_id)
    if type_id in (2, 3, 8):
        weight = rng.standard_normal((rows, k)).astype(np.float32) * 0.1
        return np.ascontiguousarray(gguf.quants.quantize(weight, qtype))
    values, block_bytes = BLOCK_SHAPES[type_id]
    blocks = rng.integers(0, 256, size=(rows, k // values, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, k // values)) * 0.01).astype(np.float16)
    scale_bytes = scales.view(np.uint8).reshape(rows, k // values, 2)
    if type_id == GGUF_MATMUL_TYPES["Q4_K"]:
        blocks[..., 0:2] = scale_bytes  # d
        blocks[..., 2:4] = scale_bytes  # dmin
    else:  # Q6_K: d last
        blocks[..., -2:] = scale_bytes
    return blocks.reshape(rows, -1)


def gguf_weight(type_id: int, rows: int, k: int = K, seed: int = 0):
    """(GgufMatmulWeight, its float32 values as the gguf package dequantizes them)."""
    blocks = quantized_blocks(type_id, rows, k, seed)
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(type_id))
    segment = GgufSegment(type_id, torch.from_numpy(blocks))
    return GgufMatmulWeight.of([segment]), torch.from_numpy(np.asarray(values, np.float32))


@pytest.mark.parametrize("type_name", list(GGUF_MATMUL_TYPES))
def test_every_block_type_dequantizes_to_the_gguf_packages_values(kernel, type_name):
    weight, values = gguf_weight(GGUF_MATMUL_TYPES[type_name], rows=37)
    ids = torch.tensor([[0, 36, 5], [5, 17, 2]])
    assert torch.equal(weight.dequantize_rows(ids), values[ids])
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 37\)"):
        weight.dequantize_rows(torch.tensor([37]))


def rounded_x_error(x: torch.Tensor, integer_bits: int) -> torch.Tensor:
    """The most each value of x moves when the integer path rounds it: half a step, a step
    being its 32-value block's largest |x| / (2^(bits-1) - 1) (float64, x's shape)."""
    largest = x.double().abs().reshape(*x.shape[:-1], -1, 32).amax(-1, keepdim=True)
    step = largest / (2 ** (integer_bits - 1) - 1)
    return (step / 2 * (1 + 1e-6)).expand(*x.shape[:-1], -1, 32).reshape(x.shape)


def rounding_bits(kernel, type_id: int, rows: int) -> int:
    """The bits x is rounded to for a call of `rows` rows on `type_id`, as the build reports
    its paths; 0: x is not rounded (a float path)."""
    if type_id in BLOCK32_TYPES and rows <= kernel.gguf_matmul_integer_max_rows():
        return kernel.gguf_matmul_integer_bits()
    if type_id in BYTE_TYPES and rows > kernel.gguf_matmul_integer_max_rows():
        return kernel.gguf_matmul_byte_bits()
    return 0


def assert_matmul(kernel, type_id, out, x, values, bias=None) -> None:
    """`out` is x @ values^T (+ bias) as the kernel's path for this call computes it: float32
    sums, plus, on a path that rounds x, at most sum |w| * (x's rounding error) more."""
    integer_bits = rounding_bits(kernel, type_id, x.reshape(-1, x.shape[-1]).shape[0])
    if integer_bits:
        expected = x.double() @ values.double().T + (0 if bias is None else bias.double())
        bound = rounded_x_error(x, integer_bits) @ values.double().abs().T
        bound += (x.double().abs() @ values.double().abs().T) * 1e-6 + 1e-6
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert bool(((out.double() - expected).abs() <= bound).all())
    else:
        assert_float32_sums(out, x, values, bias)


@pytest.mark.parametrize("type_name", list(GGUF_MATMUL_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 11, 16, 17, 37, 800])
def test_a_matmul_is_the_float32_sum_of_the_dequantized_products(kernel, type_name, rows):
    """42 columns: two whole panels and a part one, and columns past the last group of four
    on the integer path, on every path; 800 rows are nine row blocks of the panel path, enough
    that it dequantizes the whole weight once for all of them."""
    type_id = GGUF_MATMUL_TYPES[type_name]
    weight, values = gguf_weight(type_id, rows=42, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=generator)
    bias = torch.randn(42, generator=generator)
    assert_matmul(kernel, type_id, weight.matmul(x), x, values)
    assert_matmul(kernel, type_id, weight.matmul(x, bias), x, values, bias)
    strided = torch.randn(rows, K + 8, generator=generator)[:, 8:]  # a view: row stride K + 8
    assert_matmul(kernel, type_id, weight.matmul(strided), strided, values)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [96, 288, 576])
@pytest.mark.parametrize("rows", [1, 2])
def test_one_or_two_rows_sum_whole_groups_of_blocks_and_the_blocks_past_them(
    kernel, type_name, k, rows
):
    """At one row Q8_0 scales 8 blocks at a time (the others block by block): k of 3 blocks
    (no whole group), 9 (one group and one block) and 18 (SmolLM2's 576: two groups and two
    blocks)."""
    type_id = GGUF_MATMUL_TYPES[type_name]
    weight, values = gguf_weight(type_id, rows=13, k=k, seed=k + rows)
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(13, generator=generator)
    assert_matmul(kernel, type_id, weight.matmul(x, bias), x, values, bias)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("copies", [1, 4])
def test_the_rounding_paths_round_x_per_block_within_their_bound(kernel, type_name, copies):
    """Blocks of zeros, of one outlier among small values, and of values at exact steps (which
    round without error, so the result is float32-exact there); 3 rows take the integer path,
    12 (4 copies) the byte path."""
    type_id = GGUF_MATMUL_TYPES[type_name]
    weight, values = gguf_weight(type_id, rows=20, seed=7)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, K, generator=generator) * 1e-3
    x[0, :32] = 0.0  # a block of zeros
    x[1, 40] = 50.0  # an outlier: its block's other values keep (almost) no bits
    limit = 2 ** (max(rounding_bits(kernel, type_id, 3 * copies), 8) - 1) - 1
    steps = torch.randint(-limit, limit + 1, (K,), generator=generator).double()
    steps[::32] = limit  # each block's largest, so the step is exactly 2^-8
    x[2] = (steps * 2.0**-8).float()
    x = x.repeat(copies, 1)
    out = weight.matmul(x)
    assert_matmul(kernel, type_id, out, x, values)
    assert_float32_sums(out[2::3], x[2::3], values)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [3, 13, 200])
def test_every_thread_count_gives_the_same_bits(kernel, type_name, rows):
    """Each output is one thread's sum in a fixed order, whichever thread takes it: 1, 2, 3
    and 7 threads (more than the groups of 8 columns of 36 columns share out, so the byte path
    splits each group's rows into runs, down to one tile of 4 rows)."""
    type_id = GGUF_MATMUL_TYPES[type_name]
    weight, values = gguf_weight(type_id, rows=36, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    outputs = []
    saved = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3, 7):
            torch.set_num_threads(num_threads)
            outputs.append(weight.matmul(x))
    finally:
        torch.set_num_threads(saved)
    assert_matmul(kernel, type_id, outputs[0], x, values)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


@pytest.mark.parametrize("rows", [1, 9])
def test_a_weight_of_segments_of_several_types_stacks_their_outputs(kernel, rows):
    """A fused qkv of a Q4_K_M file: some rows Q4_K, some Q6_K; adjacent ones of one type are
    joined into one segment."""
    parts = [gguf_weight(type_id, 24, seed=i) for i, type_id in enumerate((12, 12, 14, 3))]
    weight = GgufMatmulWeight.of([segment for w, _ in parts for segment in w.segments])
    assert [s.type_id for s in weight.segments] == [12, 14, 3]
    assert weight.num_columns == 96 and weight.describe() == "Q4_K+Q6_K+Q4_1"
    values = torch.cat([v for _, v in parts])
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2))
    out = weight.matmul(x, bias)
    assert_float32_sums(out[:, :72], x, values[:72], bias[:72])  # the K-quant segments
    assert_matmul(kernel, 3, out[:, 72:], x, values[72:], bias[72:])
    ids = torch.tensor([0, 30, 95, 50])
    assert torch.equal(weight.dequantize_rows(ids), values[ids])


def test_segments_must_agree_on_k_and_be_blocks():
    a, _ = gguf_weight(3, 4, k=64)
    b, _ = gguf_weight(3, 4, k=128)
    with pytest.raises(ValueError, match="segments of 128 and 64 values per row"):
        GgufMatmulWeight.of([*a.segments, *b.segments])
    with pytest.raises(ValueError, match="uint8"):
        GgufMatmulWeight.of([GgufSegment(3, torch.zeros(4, 40))])
    with pytest.raises(ValueError, match="ggml type 1 is not one the GGUF matmul takes"):
        GgufSegment(1, torch.zeros(4, 40, dtype=torch.uint8)).k()
