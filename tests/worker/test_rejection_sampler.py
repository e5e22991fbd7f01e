"""RejectionSampler on hand-made logits: greedy keeps the longest matching run plus one token,
random verification leaves every returned token's distribution that of one-at-a-time sampling,
seeds reproduce, logprobs are those of the kept tokens' own rows."""

import numpy as np
import pytest
import torch

from core_engine.worker.sample.rejection_sampler import RejectionSampler
from core_engine.worker.sample.sampler import Sampler
from tests.worker.test_sampler import make_metadata, random_logits

CPU = torch.device("cpu")
VOCAB = 50
# Chi-square critical values at significance 0.001 by degrees of freedom: a correct sampler
# fails one such check in a thousand seeds; the seeds below are fixed, so the test is exact.
CHI2_CRITICAL_0_001 = {2: 13.82, 3: 16.27, 4: 18.47}


def verify(logits, drafts, seed=0, **per_row):
    metadata = make_metadata(int(logits.shape[0]), **per_row)
    return RejectionSampler(Sampler(CPU, seed=seed))(logits, metadata, drafts)


def greedy_logits(targets: list[int], seed: int = 0) -> torch.Tensor:
    """Random rows whose argmax is `targets[i]`."""
    logits = random_logits(len(targets), seed=seed)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 10.0
    return logits


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4])
def test_greedy_keeps_the_matching_run_then_the_argmax(num_drafts):
    targets = [11 + j for j in range(num_drafts + 1)]
    for num_matching in range(num_drafts + 1):
        drafts = targets[:num_matching] + [40 + j for j in range(num_drafts - num_matching)]
        out = verify(greedy_logits(targets), [drafts], temperature=0.0)
        assert out.token_ids == [targets[: num_matching + 1]], (num_matching, drafts)


def test_greedy_requests_with_and_without_drafts_share_a_batch():
    # Rows: request a (2 drafts: 3 rows), b (none: 1 row), c (1 draft: 2 rows).
    targets = [5, 6, 7, 8, 9, 10]
    drafts = [[5, 30], [], [9]]
    out = verify(greedy_logits(targets), drafts, temperature=0.0)
    assert out.token_ids == [[5, 6], [8], [9, 10]]


def test_a_request_without_drafts_is_sampled_exactly_as_the_sampler_does():
    logits = random_logits(6, seed=2)
    generators = {1: torch.Generator().manual_seed(3), 4: torch.Generator().manual_seed(4)}
    params = {"temperature": [0.0, 1.0, 0.7, 1.3, 1.0, 0.0], "top_k": 8, "num_logprobs": [2] * 6}
    expected = Sampler(CPU, seed=9)(logits, make_metadata(6, generators=generators, **params))
    generators = {1: torch.Generator().manual_seed(3), 4: torch.Generator().manual_seed(4)}
    out = verify(logits, [[]] * 6, seed=9, generators=generators, **params)
    assert out.token_ids == [[t] for t in expected.sampled_token_ids.tolist()]
    assert out.logprobs == [[lp] for lp in expected.logprobs]


def test_wrong_number_of_rows_is_refused():
    with pytest.raises(ValueError, match="2 requests with 3 drafts need 5 logits rows, got 4"):
        verify(random_logits(4), [[1, 2], [3]])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic of `counts` against `probs`; a token of probability 0 must not occur."""
    assert counts[probs == 0].sum() == 0
    n = counts.sum()
    support = probs > 0
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


def assert_distributed_as(tokens: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(probs))
    statistic = chi_square(counts, probs)
    critical = CHI2_CRITICAL_0_001[int((probs > 0).sum()) - 1]
    assert statistic < critical, (counts / counts.sum(), probs)


# Each verified position's target distribution over a five-token vocabulary.
POSITION_PROBS = np.array(
    [
        [0.10, 0.30, 0.20, 0.25, 0.15],
        [0.40, 0.10, 0.30, 0.10, 0.10],
        [0.05, 0.05, 0.50, 0.20, 0.20],
    ]
)
DRAFTS = [1, 0]  # p = 0.30 at position 0, 0.40 at position 1


def sample_many(num_requests: int, seed: int, position_probs=POSITION_PROBS, **params):
    logits = torch.tensor(np.log(position_probs), dtype=torch.float32).repeat(num_requests, 1)
    out = verify(logits, [DRAFTS] * num_requests, seed=seed, **params)
    return out.token_ids


def test_random_verification_keeps_each_returned_token_distributed_as_the_target():
    """The first token is distributed as p_0 whatever the draft; given the first draft was
    accepted the second is distributed as p_1; given both, the bonus token as p_2."""
    token_ids = sample_many(40000, seed=1)
    first = np.array([t[0] for t in token_ids])
    assert_distributed_as(first, POSITION_PROBS[0])
    second = np.array([t[1] for t in token_ids if len(t) > 1])
    assert len(second) == pytest.approx(40000 * 0.30, rel=0.05)
    assert_distributed_as(second, POSITION_PROBS[1])
    third = np.array([t[2] for t in token_ids if len(t) > 2])
    assert_distributed_as(third, POSITION_PROBS[2])
    # The check has power: the draft itself is over-represented under a naive "always accept".
    assert chi_square(np.bincount(np.full(len(first), 1), minlength=5), POSITION_PROBS[0]) > 1e3
    naive = np.where(np.arange(len(first)) % 2 == 0, 1, first)  # half the rows forced to d_1
    naive_counts = np.bincount(naive, minlength=5)
    assert chi_square(naive_counts, POSITION_PROBS[0]) > CHI2_CRITICAL_0_001[4]


def test_random_verification_applies_temperature_and_top_k_at_every_position():
    """The target is the processed distribution: temperature 0.5 sharpens, top-k 3 cuts."""
    temperature, top_k = 0.5, 3
    token_ids = sample_many(30000, seed=2, temperature=temperature, top_k=top_k)
    processed = POSITION_PROBS ** (1 / temperature)
    kept = np.argsort(-processed, axis=1)[:, :top_k]
    mask = np.zeros_like(processed, dtype=bool)
    np.put_along_axis(mask, kept, True, axis=1)
    processed = np.where(mask, processed, 0.0)
    processed /= processed.sum(axis=1, keepdims=True)
    first = np.array([t[0] for t in token_ids])
    assert_distributed_as(first, processed[0])
    second = np.array([t[1] for t in token_ids if len(t) > 1])
    assert_distributed_as(second, processed[1])


def test_a_draft_the_filters_remove_is_always_rejected():
    top_k_probs = POSITION_PROBS.copy()
    top_k_probs[0] = [0.05, 0.05, 0.40, 0.30, 0.20]  # draft 1 is outside the top 3
    token_ids = sample_many(2000, seed=3, position_probs=top_k_probs, top_k=3)
    assert all(len(t) == 1 and t[0] in (2, 3, 4) for t in token_ids)


def test_a_seeded_request_reproduces_whatever_its_neighbours():
    logits = random_logits(4, seed=6)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), 3]

    def run(position: int, num_others: int, sampler_seed: int) -> list[list[int]]:
        """Eight steps of the seeded request (4 rows) among `num_others` unseeded 2-row ones."""
        generator = torch.Generator().manual_seed(11)
        results = []
        for step in range(8):
            parts = [random_logits(2, seed=50 + step + k) for k in range(num_others)]
            parts.insert(position, logits)
            all_drafts = [[7]] * num_others
            all_drafts.insert(position, drafts)
            first_row = 2 * position
            out = verify(
                torch.cat(parts),
                all_drafts,
                seed=sampler_seed + step,
                temperature=1.0,
                generators={first_row + j: generator for j in range(4)},
            )
            results.append(out.token_ids[position])
        return results

    alone = run(0, 0, sampler_seed=0)
    assert alone == run(2, 3, sampler_seed=100) == run(0, 2, sampler_seed=7)
    assert len({tuple(t) for t in alone}) > 1  # really random


def test_logprobs_are_those_of_each_kept_token_at_its_own_row():
    logits = greedy_logits([4, 9, 13, 21], seed=8)
    out = verify(logits, [[4, 9, 30]], temperature=0.0, num_logprobs=[3] * 4)
    assert out.token_ids == [[4, 9, 13]]
    expected = torch.log_softmax(logits, dim=-1)
    (entries,) = out.logprobs
    assert len(entries) == 3
    for row, (token, entry) in enumerate(zip(out.token_ids[0], entries, strict=True)):
        assert entry.sampled_logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        assert entry.sampled_rank == 1
        assert entry.top_token_ids == expected[row].topk(3).indices.tolist()


def test_logprobs_only_for_requests_that_asked():
    logits = greedy_logits([4, 9, 13, 21, 22], seed=8)
    out = verify(logits, [[4, 9], [1]], temperature=0.0, num_logprobs=[None] * 3 + [0] * 2)
    assert out.logprobs[0] is None
    assert [e.top_token_ids for e in out.logprobs[1]] == [[]]
