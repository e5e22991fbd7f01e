"""Draft proposers of speculative decoding (n-gram prompt lookup, suffix decoding) and the
`Drafter`'s limits, on hand-built token sequences."""

from __future__ import annotations

import pytest

from core_engine.core.spec_decode.drafter import Drafter
from core_engine.core.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from core_engine.core.spec_decode.spec_decoding_stats import SpecDecodingStats
from core_engine.core.spec_decode.suffix_index import SpeculationLimits, SuffixIndex
from core_engine.core.spec_decode.suffix_proposer import SuffixProposer
from core_engine.proto.speculative_config import SpeculativeConfig
from tests.helpers.core_factories import make_request


def _decoding_request(request_id, prompt, output=(), max_tokens=64):
    """A request whose prompt and output are computed but its last token."""
    request = make_request(request_id, list(prompt), max_tokens=max_tokens)
    request.append_output_token_ids(list(output))
    request.num_computed_tokens = request.num_tokens - 1
    return request


# ---- n-gram ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_match():
    # The last 3 tokens (7, 8, 9) occurred at 4; only (8, 9) occurred at 0 as well.
    tokens = [8, 9, 1, 2, 7, 8, 9, 5, 6, 3, 7, 8, 9]
    index = NgramIndex(min_n=2, max_n=3)
    assert index.propose(tokens, 3) == [5, 6, 3]


def test_ngram_picks_the_earliest_occurrence_of_the_longest_match():
    tokens = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5]
    assert NgramIndex(min_n=1, max_n=2).propose(tokens, 2) == [10, 11]


def test_ngram_drafts_a_repeating_pattern_through_its_own_suffix():
    # The match at 0 overlaps the suffix: the draft runs into the tokens the suffix holds.
    tokens = [3, 3, 3, 3]
    assert NgramIndex(min_n=1, max_n=3).propose(tokens, 5) == [3]
    assert NgramIndex(min_n=1, max_n=2).propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2]


def test_ngram_needs_a_match_of_at_least_min_n_tokens():
    tokens = [1, 2, 3, 9, 2, 3]
    assert NgramIndex(min_n=3, max_n=4).propose(tokens, 4) == []
    assert NgramIndex(min_n=2, max_n=4).propose(tokens, 4) == [9, 2, 3]
    assert NgramIndex(min_n=1, max_n=1).propose([5], 4) == []


def test_ngram_index_grows_with_the_sequence_like_a_fresh_one():
    tokens = [1, 2, 3, 1, 2]
    grown = NgramIndex(min_n=1, max_n=3)
    assert grown.propose(tokens, 2) == [3, 1]
    for token in [4, 1, 2, 3, 1, 2, 4, 7, 1]:
        tokens.append(token)
        assert grown.propose(tokens, 3) == NgramIndex(min_n=1, max_n=3).propose(tokens, 3)
    assert grown.num_indexed == len(tokens)


def test_ngram_proposer_keeps_one_index_per_request_until_removed():
    proposer = NgramProposer(2, 3)
    request = _decoding_request("a", [1, 2, 3, 4, 1, 2])
    assert proposer.propose(request, 2) == [3, 4]
    request.append_output_token_ids([3])
    assert proposer.propose(request, 2) == [4, 1]
    assert proposer.num_tracked_requests == 1
    proposer.remove_request(request)
    assert proposer.num_tracked_requests == 0
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)


# ---- suffix ------------------------------------------------------------------------------

LIMITS = SpeculationLimits(max_tree_depth=24, max_spec_factor=1.0, min_token_prob=0.1,
                           max_num_tokens=8)  # fmt: skip


def _index(*sequences):
    index = SuffixIndex()
    for sequence_id, tokens in enumerate(sequences):
        index.add_sequence(sequence_id, list(tokens))
    return index


def test_suffix_draft_length_follows_the_match_length():
    index = _index([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # A match of 2 tokens (2, 3) drafts at most 2 tokens at factor 1, 4 at factor 2.
    assert index.speculate([9, 9, 2, 3], LIMITS).token_ids == [4, 5]
    double = SpeculationLimits(24, 2.0, 0.1, 8)
    assert index.speculate([9, 9, 2, 3], double).token_ids == [4, 5, 6, 7]
    # A longer match drafts more, up to max_num_tokens.
    draft = index.speculate([1, 2, 3, 4, 5, 6], LIMITS)
    assert (draft.token_ids, draft.match_length, draft.score) == ([7, 8, 9], 6, 3.0)


def test_suffix_draft_follows_the_most_frequent_child_while_likely_enough():
    # After (1, 2): 3 three times, 4 once; after (1, 2, 3): 5 twice, 6 once.
    index = _index([1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 0])
    limits = SpeculationLimits(24, 4.0, 0.1, 8)
    draft = index.speculate([7, 1, 2], limits)
    assert draft.token_ids == [3, 5]
    assert draft.score == pytest.approx(3 / 4 + 3 / 4 * 2 / 3)
    # Probability 3/4 * 2/3 = 0.5 is below 0.6: the draft stops after 3.
    strict = SpeculationLimits(24, 4.0, 0.6, 8)
    assert index.speculate([7, 1, 2], strict).token_ids == [3]


def test_suffix_tree_depth_bounds_match_plus_draft():
    index = _index(list(range(1, 20)))
    shallow = SpeculationLimits(max_tree_depth=6, max_spec_factor=4.0, min_token_prob=0.1,
                                max_num_tokens=8)  # fmt: skip
    draft = index.speculate([1, 2, 3, 4, 5, 6, 7, 8], shallow)
    assert draft.match_length == 5  # at most depth - 1 tokens are matched
    assert draft.token_ids == [9]  # and match + draft <= depth


def test_suffix_index_forgets_its_oldest_sequence():
    index = _index([1, 2, 3, 4], [5, 6, 7, 8])
    assert index.speculate([1, 2], LIMITS).token_ids == [3, 4]
    index.pop_oldest_sequence()
    assert len(index) == 1
    assert index.speculate([1, 2], LIMITS).token_ids == []
    assert index.speculate([5, 6], LIMITS).token_ids == [7, 8]


def test_suffix_proposer_drafts_from_earlier_outputs_and_its_own_tokens():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                               suffix_decoding_max_cached_requests=1)  # fmt: skip
    proposer = SuffixProposer(config)
    first = _decoding_request("first", [50, 51], output=[10, 11, 12, 13, 14, 15])
    proposer.remove_request(first)  # finished: its output joins the global index
    second = _decoding_request("second", [60, 10, 11, 12])
    assert proposer.propose(second, 4) == [13, 14, 15]
    own = _decoding_request("own", [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert proposer.propose(own, 4) == [4, 5, 9]
    assert proposer.num_tracked_requests == 2
    second.append_output_token_ids([30])
    proposer.remove_request(second)  # evicts `first`: one cached request at most
    assert len(proposer.global_index) == 1
    third = _decoding_request("third", [70, 10, 11, 12])
    assert proposer.propose(third, 4) == []


# ---- drafter and stats -------------------------------------------------------------------


def test_drafter_respects_max_tokens_max_model_len_and_prefill():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    drafter = Drafter(config, max_model_len=20)
    prompt = [1, 2, 3, 4, 5, 6, 1]
    assert drafter.max_num_draft_tokens(_decoding_request("a", prompt, [2])) == 4
    # Prompt done but its last token not computed: a prefill step, never drafted.
    assert drafter.max_num_draft_tokens(_decoding_request("a0", prompt)) == 0
    # max_tokens 3 with 1 token out: 2 more may come, one of them sampled after the drafts.
    assert drafter.max_num_draft_tokens(_decoding_request("b", prompt, [3], max_tokens=3)) == 1
    assert drafter.max_num_draft_tokens(_decoding_request("c", prompt, [3], max_tokens=2)) == 0
    # 18 tokens of max_model_len 20: one draft, then the token after it reaches 20.
    long = _decoding_request("d", prompt + [0] * 10, [0])
    assert drafter.max_num_draft_tokens(long) == 1
    prefilling = _decoding_request("e", prompt, [2])
    prefilling.num_computed_tokens = 4  # recomputing after a preemption
    assert drafter.max_num_draft_tokens(prefilling) == 0
    decoding = _decoding_request("f", prompt, [2])
    drafter.propose_drafts([prefilling, decoding])
    assert (prefilling.spec_token_ids, decoding.spec_token_ids) == ([], [3, 4, 5, 6])


def test_drafter_turns_off_at_disable_by_batch_size():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                               prompt_lookup_min=1, disable_by_batch_size=3)  # fmt: skip
    drafter = Drafter(config, max_model_len=64)
    batch = [_decoding_request(str(i), [1, 2, 3, 1], [2]) for i in range(3)]
    drafter.propose_drafts(batch[:2])
    assert [r.spec_token_ids for r in batch[:2]] == [[3, 1], [3, 1]]
    drafter.propose_drafts(batch)
    assert [r.spec_token_ids for r in batch] == [[], [], []]


def test_spec_decoding_stats_count_per_position():
    stats = SpecDecodingStats(num_speculative_tokens=3)
    stats.observe_draft(3, 2)
    stats.observe_draft(2, 0)
    stats.observe_draft(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1]
    with pytest.raises(ValueError, match="cannot have 3 accepted"):
        stats.observe_draft(2, 3)
