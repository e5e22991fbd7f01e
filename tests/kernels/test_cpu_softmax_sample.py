"""The softmax sampling C kernel (`kernels/cpu/softmax_sample.c`) on every kernel build this host
runs: each draw lands in its token's interval of the float64 softmax CDF (to float32 rounding of
the masses), agrees with `sample_inverse_cdf` of torch's softmax, never takes a token of weight
0, and is the same token on every build and thread count; a bad temperature or shape is refused
by name."""

from __future__ import annotations

import pytest
import torch

from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu import softmax_sample as cpu_softmax_sample
from core_engine.worker.sample.inverse_cdf import sample_inverse_cdf
from tests.helpers.cpu_kernel_builds import compiler, kernel_library_fixtures

build, kernel = kernel_library_fixtures("softmax_sample.c")
# Where a draw may land outside its token's float64 interval: float32 sums of the weights are
# off by a few ulps of a chunk's mass, so near an interval's edge the neighbour may be drawn.
CDF_TOLERANCE = 1e-5


def draw(logits, temperatures, uniforms, num_threads: int = 1) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return cpu_softmax_sample.softmax_sample(logits, temperatures, uniforms)
    finally:
        torch.set_num_threads(previous)


def rows_with_draws(vocab: int, num_draws: int, seed: int):
    """One row of logits (a tenth of them -inf, as banned tokens) repeated for `num_draws`
    uniforms, at a temperature per draw."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=generator) * 4
    row[torch.randperm(vocab, generator=generator)[: vocab // 10]] = float("-inf")
    logits = row.expand(num_draws, vocab).contiguous()
    temperatures = torch.tensor([0.5, 1.0, 1.7])[torch.arange(num_draws) % 3]
    uniforms = torch.rand(num_draws, generator=generator, dtype=torch.float64)
    return logits, temperatures, uniforms


@pytest.mark.parametrize("vocab", [1000, 49152])  # a last chunk of 232 tokens; SmolLM2's
def test_each_draw_lands_in_its_tokens_interval(kernel, vocab):
    logits, temperatures, uniforms = rows_with_draws(vocab, 300, seed=vocab)
    tokens = draw(logits, temperatures, uniforms)
    probs = torch.softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    rows = torch.arange(len(tokens))
    above = cdf[rows, tokens]
    below = torch.where(tokens > 0, cdf[rows, (tokens - 1).clamp_min(0)], 0.0)
    assert bool((probs[rows, tokens] > 0).all()), "a banned token was drawn"
    assert bool((below - CDF_TOLERANCE <= uniforms).all())
    assert bool((uniforms <= above + CDF_TOLERANCE).all())
    reference = sample_inverse_cdf(torch.softmax(logits / temperatures[:, None], dim=-1), uniforms)
    assert (tokens == reference).float().mean() >= 0.99


def test_every_build_and_thread_count_draws_the_same_tokens(kernel, build):
    logits, temperatures, uniforms = rows_with_draws(3000, 64, seed=7)
    one_thread = draw(logits, temperatures, uniforms)
    assert torch.equal(draw(logits, temperatures, uniforms, num_threads=2), one_thread)
    host = cpu_kernel_loader.open_library(cpu_kernel_loader.build(compiler()))
    tokens = torch.empty(64, dtype=torch.int64)
    host.softmax_sample(logits.data_ptr(), logits.stride(0), 64, 3000, temperatures.data_ptr(),
                        uniforms.data_ptr(), tokens.data_ptr(), 1)  # fmt: skip
    assert torch.equal(tokens, one_thread), f"{build.name} differs from this host's build"


def test_edges_of_a_row(kernel):
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [-inf, -inf, -inf, -inf],  # nothing positive: token 0
            [-inf, 2.0, -inf, -inf],  # one finite logit: always it
            [1.0, nan, 1.0, -inf],  # NaN weighs 0
            [0.0, 0.0, 0.0, -inf],  # a draw at the very end: the last positive token
            [0.0, -200.0, 0.0, 0.0],  # 200 temperatures down: weight 0, never drawn
        ]
    )
    uniforms = torch.tensor([0.5, 0.99, 0.5, 1.0 - 2**-53, 0.34], dtype=torch.float64)
    tokens = draw(logits, torch.ones(5), uniforms)
    assert tokens.tolist() == [0, 1, 2, 2, 2]


def test_a_strided_row_and_the_temperature(kernel):
    wide = torch.full((2, 600), -50.0)
    wide[:, 3], wide[:, 260] = 0.0, -1.0  # two tokens in different chunks, e^-1 apart at t=1
    logits = wide[:, :300]  # rows 600 floats apart
    uniforms = torch.tensor([0.8, 0.8], dtype=torch.float64)
    cold, hot = draw(logits, torch.tensor([0.1, 100.0]), uniforms).tolist()
    assert cold == 3  # t = 0.1: token 260 weighs e^-10
    assert hot != 3  # t = 100: 298 tokens of nearly equal weight; 0.8 lands past token 3


def test_bad_temperatures_and_shapes_are_refused_by_name(kernel):
    logits = torch.zeros(3, 10)
    uniforms = torch.full((3,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="positive temperatures, got 0.0 in row 1"):
        draw(logits, torch.tensor([1.0, 0.0, 1.0]), uniforms)
    with pytest.raises(ValueError, match="positive temperatures, got nan in row 2"):
        draw(logits, torch.tensor([1.0, 1.0, float("nan")]), uniforms)
    with pytest.raises(ValueError, match="3 temperatures and uniforms, got \\(2,\\)"):
        draw(logits, torch.ones(2), uniforms)


def test_supports_only_float32_cpu_rows_of_unit_stride(kernel):
    assert cpu_softmax_sample.supports(torch.zeros(2, 8))
    assert not cpu_softmax_sample.supports(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not cpu_softmax_sample.supports(torch.zeros(8, 2).t())
    assert not cpu_softmax_sample.supports(torch.zeros(8))
