"""Sampler: filters never emit excluded tokens, seeds are batch-invariant, logprobs are exact."""

import math

import pytest
import torch

from core_engine.kernels.cpu import softmax_sample as cpu_softmax_sample
from core_engine.worker.sample.sampler import (
    RowPenalties,
    Sampler,
    SamplingMetadata,
    _apply_penalties,
    greedy_token_ids,
)

CPU = torch.device("cpu")
VOCAB = 50


def make_metadata(num_rows: int, **per_row) -> SamplingMetadata:
    """Same parameters for every row unless a list is given."""

    def column(name, default, dtype):
        value = per_row.get(name, default)
        if not isinstance(value, list):
            value = [value] * num_rows
        return torch.tensor(value, dtype=dtype)

    return SamplingMetadata(
        temperature=column("temperature", 1.0, torch.float32),
        top_k=column("top_k", 0, torch.int64),
        top_p=column("top_p", 1.0, torch.float32),
        min_p=column("min_p", 0.0, torch.float32),
        generators=per_row.get("generators", {}),
        num_logprobs=per_row.get("num_logprobs", [None] * num_rows),
        banned_token_ids=per_row.get("banned_token_ids", {}),
    )


def logits_from_probs(probs: list[float], num_rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(num_rows, -1).clone()


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def sampled_set(logits: torch.Tensor, metadata: SamplingMetadata, seed: int = 0) -> set[int]:
    return set(Sampler(CPU, seed=seed)(logits, metadata).sampled_token_ids.tolist())


def test_temperature_zero_is_argmax_even_next_to_random_rows():
    logits = random_logits(8)
    temperature = [0.0, 1.5] * 4
    out = Sampler(CPU)(logits, make_metadata(8, temperature=temperature, top_k=5))
    greedy_rows = out.sampled_token_ids[0::2]
    assert torch.equal(greedy_rows, logits.argmax(dim=-1)[0::2])


def test_top_k_never_emits_tokens_outside_the_k_best():
    num_rows = 2000
    logits = random_logits(1).expand(num_rows, -1).clone()
    allowed = set(logits[0].topk(4).indices.tolist())
    seen = sampled_set(logits, make_metadata(num_rows, temperature=2.0, top_k=4))
    assert seen == allowed


def test_top_p_keeps_smallest_prefix_reaching_p():
    num_rows = 2000
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], num_rows)
    assert sampled_set(logits, make_metadata(num_rows, top_p=0.7)) == {0, 1}
    assert sampled_set(logits, make_metadata(num_rows, top_p=0.4)) == {0}


def test_min_p_drops_tokens_below_fraction_of_best():
    num_rows = 2000
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], num_rows)
    assert sampled_set(logits, make_metadata(num_rows, min_p=0.2)) == {0, 1, 2}


def test_filters_combine_per_row():
    num_rows = 1000
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1], 2 * num_rows)
    top_k = [2] * num_rows + [0] * num_rows
    min_p = [0.0] * num_rows + [0.6] * num_rows
    out = Sampler(CPU)(logits, make_metadata(2 * num_rows, top_k=top_k, min_p=min_p))
    assert set(out.sampled_token_ids[:num_rows].tolist()) == {0, 1}
    assert set(out.sampled_token_ids[num_rows:].tolist()) == {0, 1}


def test_sampling_follows_the_distribution():
    num_rows = 20000
    probs = [0.6, 0.3, 0.1]
    out = Sampler(CPU)(logits_from_probs(probs, num_rows), make_metadata(num_rows))
    counts = torch.bincount(out.sampled_token_ids, minlength=3).float() / num_rows
    assert counts.tolist() == pytest.approx(probs, abs=0.02)


def test_temperature_flattens_the_distribution():
    num_rows = 20000
    out = Sampler(CPU)(
        logits_from_probs([0.8, 0.2], num_rows), make_metadata(num_rows, temperature=100.0)
    )
    share_of_second = out.sampled_token_ids.float().mean().item()
    assert share_of_second == pytest.approx(0.5, abs=0.03)


def seeded_tokens(position: int, batch_size: int, num_steps: int, other_seed: int) -> list[int]:
    """Samples `num_steps` times with a seed-7 request at `position` among unseeded rows."""
    sampler = Sampler(CPU, seed=other_seed)
    generator = torch.Generator().manual_seed(7)
    row_logits = random_logits(1, seed=3)[0]
    tokens = []
    for step in range(num_steps):
        logits = random_logits(batch_size, seed=100 + step + other_seed)
        logits[position] = row_logits
        out = sampler(logits, make_metadata(batch_size, generators={position: generator}))
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_seed_reproduces_across_batch_compositions():
    alone = seeded_tokens(position=0, batch_size=1, num_steps=20, other_seed=0)
    in_batch = seeded_tokens(position=3, batch_size=6, num_steps=20, other_seed=1)
    at_front = seeded_tokens(position=0, batch_size=9, num_steps=20, other_seed=2)
    assert alone == in_batch == at_front
    assert len(set(alone)) > 1  # really random, not a constant


def test_unseeded_rows_differ_between_sampler_seeds():
    logits = torch.zeros(64, VOCAB)
    a = Sampler(CPU, seed=0)(logits, make_metadata(64)).sampled_token_ids
    b = Sampler(CPU, seed=1)(logits, make_metadata(64)).sampled_token_ids
    assert not torch.equal(a, b)


def test_logprobs_equal_log_softmax_of_raw_logits():
    logits = random_logits(3)
    metadata = make_metadata(3, temperature=[0.0, 0.5, 1.0], top_k=3, num_logprobs=[5, None, 0])
    out = Sampler(CPU)(logits, metadata)
    expected = torch.log_softmax(logits, dim=-1)

    greedy = out.logprobs[0]
    top = expected[0].topk(5)
    assert greedy.top_token_ids == top.indices.tolist()
    assert greedy.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert greedy.sampled_rank == 1
    assert greedy.sampled_logprob == pytest.approx(top.values[0].item(), abs=1e-6)

    assert out.logprobs[1] is None
    third = out.logprobs[2]
    token = int(out.sampled_token_ids[2])
    assert third.top_token_ids == [] and third.top_logprobs == []
    assert third.sampled_logprob == pytest.approx(expected[2, token].item(), abs=1e-6)
    assert third.sampled_rank == 1 + int((expected[2] > expected[2, token]).sum())
    assert math.isfinite(third.sampled_logprob)


def test_banned_tokens_are_never_sampled():
    logits = logits_from_probs([0.9, 0.05, 0.05], 500)
    banned = {row: [0] for row in range(500)}
    out = Sampler(CPU)(logits, make_metadata(500, banned_token_ids=banned))
    assert 0 not in set(out.sampled_token_ids.tolist())
    greedy = Sampler(CPU)(logits[:1], make_metadata(1, temperature=0.0, banned_token_ids={0: [0]}))
    assert greedy.sampled_token_ids.tolist() != [0]


def test_extreme_logits_give_valid_tokens():
    logits = torch.full((4, VOCAB), -1e30)
    logits[:, 7] = 0.0
    out = Sampler(CPU)(logits, make_metadata(4, top_p=0.1, min_p=0.9, top_k=1))
    assert out.sampled_token_ids.tolist() == [7, 7, 7, 7]


def reference_penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], presence, frequency, repetition
) -> torch.Tensor:
    """OpenAI's and vLLM's penalty definitions, token by token."""
    expected = logits.clone()
    for token in set(prompt) | set(output):
        value = float(expected[token])
        expected[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        expected[token] -= frequency * output.count(token) + presence
    return expected


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (1.0, 0.5, 0.8), (-0.5, -1.0, 1.0)],
)
def test_penalties_match_a_direct_reference_and_touch_only_their_row(
    presence, frequency, repetition
):
    logits = random_logits(3, seed=4) * 3
    prompt, output = [1, 2, 3, 3], [3, 5, 5, 5, 7]
    penalties = {
        1: RowPenalties(presence, frequency, repetition, torch.tensor(prompt), torch.tensor(output))
    }
    metadata = make_metadata(3, temperature=0.0, num_logprobs=[None, 0, None])
    metadata.penalties = penalties
    processed = logits.clone()
    _apply_penalties(processed, penalties)
    expected = reference_penalized(logits[1], prompt, output, presence, frequency, repetition)
    torch.testing.assert_close(processed[1], expected)
    assert torch.equal(processed[0::2], logits[0::2])
    out = Sampler(CPU)(logits, metadata)
    assert out.sampled_token_ids.tolist() == processed.argmax(dim=-1).tolist()
    # Logprobs stay those of the model's raw logits, as in vLLM.
    assert out.logprobs[1].sampled_logprob == pytest.approx(
        float(torch.log_softmax(logits[1], -1)[out.sampled_token_ids[1]])
    )


def test_logit_bias_can_force_or_forbid_a_token():
    logits = random_logits(2, seed=5)
    metadata = make_metadata(2, temperature=0.0)
    best = int(logits[0].argmax())
    metadata.logit_bias = {0: ([7], [100.0]), 1: ([int(logits[1].argmax())], [-100.0])}
    sampled = Sampler(CPU)(logits, metadata).sampled_token_ids.tolist()
    assert sampled[0] == 7
    assert sampled[1] == int(logits[1].topk(2).indices[1])
    assert best == int(logits[0].argmax())  # the caller's logits are not changed


def test_several_penalized_rows_each_get_their_own_penalties_in_one_pass():
    logits = random_logits(4, seed=9) * 3
    histories = {
        0: ([1, 2], [2, 2, 3], (0.3, 0.5, 1.2)),
        2: ([4, 4, 4, 9], [], (1.0, 1.0, 0.7)),
        3: ([], [8, 8, 8, 8, 1], (-0.5, 0.25, 1.0)),
    }
    penalties = {
        row: RowPenalties(*params, torch.tensor(prompt), torch.tensor(output))
        for row, (prompt, output, params) in histories.items()
    }
    processed = logits.clone()
    _apply_penalties(processed, penalties)
    for row, (prompt, output, params) in histories.items():
        expected = reference_penalized(logits[row], prompt, output, *params)
        torch.testing.assert_close(processed[row], expected)
    assert torch.equal(processed[1], logits[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_token_ids_are_torch_argmax_with_ties_nan_and_strides(dtype):
    """The numpy route (CPU float32) and torch's agree on the first of equal largest values, on a
    NaN counting as the largest, on all -inf rows and on a strided view (a padded vocab)."""
    logits = torch.randn(6, 2 * VOCAB, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, [7, 30]] = 50.0  # a tie: the first wins
    logits[2, [4, 9]] = float("nan")
    logits[3] = float("-inf")
    view = logits[:, :VOCAB]  # rows 2 * VOCAB apart
    for batch in (logits, view, view[4:5]):
        ids = greedy_token_ids(batch)
        assert ids.dtype == torch.int64 and ids.tolist() == batch.argmax(dim=-1).tolist()
    assert greedy_token_ids(logits)[1:4].tolist() == [7, 4, 0]


def test_plain_temperature_rows_draw_what_the_torch_route_draws(monkeypatch):
    """Rows with a temperature and no filter go through softmax_sample.c on a CPU; from the
    same uniforms it draws what target_probs + sample_inverse_cdf draw (but for a draw within
    float32 rounding of a token's edge)."""
    logits = random_logits(64, seed=5) * 3
    if not cpu_softmax_sample.supports(logits):
        pytest.skip("no C compiler: the CPU kernels are not built")
    metadata = make_metadata(64, temperature=[0.0, 0.7, 1.0, 1.3] * 16)
    through_c = Sampler(CPU, seed=1)(logits, metadata).sampled_token_ids
    monkeypatch.setattr(cpu_softmax_sample, "supports", lambda logits: False)
    through_torch = Sampler(CPU, seed=1)(logits, metadata).sampled_token_ids
    assert torch.equal(through_c[::4], logits[::4].argmax(dim=-1))  # greedy rows stay argmax
    assert (through_c == through_torch).float().mean() >= 0.95
    assert len(set(through_c[1::4].tolist())) > 1  # really drawn, not a constant
