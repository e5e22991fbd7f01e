"""The two-level inverse-CDF draw behind random sampling: right frequencies, zero entries never
drawn, exact at the extremes of the uniform, and precise for tail tokens a float32 running
sum over the whole vocabulary would lose."""

import math

import torch

from core_engine.worker.sample.inverse_cdf import CHUNK, sample_inverse_cdf


def _distribution_with_holes(vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(vocab_size, generator=generator) ** 4
    probs[CHUNK : 2 * CHUNK] = 0.0  # a whole chunk without mass
    probs[CHUNK - 3 : CHUNK] = 0.0  # zeros at the end of a chunk
    probs[-5:] = 0.0  # and at the end of the row
    probs[::7] = 0.0
    return probs


def test_frequencies_follow_the_entries_and_zero_entries_are_never_drawn():
    vocab_size = 3 * CHUNK + 88  # the last chunk is padded
    probs = _distribution_with_holes(vocab_size)
    num_draws = 40_000
    uniforms = torch.rand(
        num_draws, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    tokens = sample_inverse_cdf(probs.expand(num_draws, -1), uniforms)
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    assert counts[probs == 0].sum() == 0
    expected = num_draws * probs.double() / probs.double().sum()
    sigma = (expected * (1 - expected / num_draws)).sqrt()
    checked = expected >= 20
    assert int(checked.sum()) > 50
    z = (counts[checked] - expected[checked]) / sigma[checked]
    assert float(z.abs().max()) < 5.5, float(z.abs().max())
    chi_square = float((z**2).sum())
    degrees = int(checked.sum())
    assert chi_square < degrees + 6 * math.sqrt(2 * degrees), (chi_square, degrees)


def test_extreme_uniforms_take_the_first_and_the_last_positive_entry():
    probs = _distribution_with_holes(2 * CHUNK + 40)
    positive = torch.nonzero(probs > 0).squeeze(1)
    below_one = math.nextafter(1.0, 0.0)
    tokens = sample_inverse_cdf(
        probs.expand(2, -1), torch.tensor([0.0, below_one], dtype=torch.float64)
    )
    assert tokens.tolist() == [int(positive[0]), int(positive[-1])]


def test_a_scaled_row_draws_the_same_tokens():
    probs = _distribution_with_holes(CHUNK * 2 + 1).expand(500, -1)
    uniforms = torch.rand(500, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.equal(
        sample_inverse_cdf(probs, uniforms), sample_inverse_cdf(probs * 7.0, uniforms)
    )


def test_each_uniform_lands_on_the_token_whose_interval_holds_it():
    """Token i owns [cdf[i-1], cdf[i]) of the row's mass (cdf in float64): uniforms just inside
    either end of every token's interval draw that token. "Just inside" is 1e-5 of the token's
    chunk mass, the float32 running sum within a chunk being that precise; tokens narrower than
    four such margins are left out."""
    probs = _distribution_with_holes(CHUNK + 77, seed=3)
    cdf = torch.cumsum(probs.double(), dim=0)
    total = float(cdf[-1])
    chunk_mass = torch.nn.functional.pad(probs, (0, -probs.numel() % CHUNK)).view(-1, CHUNK).sum(1)
    uniforms, wanted = [], []
    for token in torch.nonzero(probs > 0).squeeze(1).tolist():
        low = float(cdf[token - 1]) if token else 0.0
        high = float(cdf[token])
        margin = 1e-5 * float(chunk_mass[token // CHUNK])
        if high - low < 4 * margin:
            continue
        for inside in (low + margin, high - margin):
            uniforms.append(inside / total)
            wanted.append(token)
    assert len(wanted) > 200
    tokens = sample_inverse_cdf(
        probs.expand(len(uniforms), -1), torch.tensor(uniforms, dtype=torch.float64)
    )
    assert tokens.tolist() == wanted


def test_a_tail_token_far_below_float32_resolution_keeps_its_share():
    """With mass 1 on token 0 and 1e-9 on a token 30,000 entries later, a float32 running sum
    over the row never moves past 1.0 and the tail token could not be drawn; the chunked sum
    draws it exactly for the uniforms of its share."""
    probs = torch.zeros(49_152)
    probs[0] = 1.0
    probs[30_000] = 1e-9
    total = 1.0 + 1e-9
    uniforms = torch.tensor(
        [0.5, (1.0 + 0.25e-9) / total, (1.0 + 0.75e-9) / total], dtype=torch.float64
    )
    assert sample_inverse_cdf(probs.expand(3, -1), uniforms).tolist() == [0, 30_000, 30_000]


def test_a_row_without_mass_draws_token_zero():
    probs = torch.zeros(2, CHUNK + 10)
    probs[1, 5] = 1.0
    uniforms = torch.tensor([0.3, 0.3], dtype=torch.float64)
    assert sample_inverse_cdf(probs, uniforms).tolist() == [0, 5]
