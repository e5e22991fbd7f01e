"""`AdaptiveDraftLength` on its own, and through the scheduler: a request whose drafts fail
gets shorter ones, one whose drafts all pass gets them back up to num_speculative_tokens."""

from __future__ import annotations

import pytest

from core_engine.core.spec_decode.draft_length import AdaptiveDraftLength
from core_engine.proto.speculative_config import SpeculativeConfig
from tests.core.test_scheduler_spec_decode import PERIOD, _periodic_model, _periodic_prompt, step
from tests.helpers.core_factories import make_request, make_scheduler


def test_a_request_starts_at_the_most_and_halves_on_rejection_doubles_on_acceptance():
    lengths = AdaptiveDraftLength(8)
    assert lengths.length("a") == 8
    lengths.observe("a", 8, 0)
    assert lengths.length("a") == 4
    lengths.observe("a", 4, 0)
    lengths.observe("a", 2, 0)
    lengths.observe("a", 1, 0)
    assert lengths.length("a") == 1  # never below one
    lengths.observe("a", 1, 1)
    assert lengths.length("a") == 2
    lengths.observe("a", 2, 1)  # partly accepted: unchanged
    assert lengths.length("a") == 2
    for _ in range(5):
        lengths.observe("a", lengths.length("a"), lengths.length("a"))
    assert lengths.length("a") == 8  # never above the most
    assert lengths.length("b") == 8  # per request
    lengths.remove("a")
    assert lengths.num_tracked_requests == 0


def test_a_draft_cut_short_by_the_budget_counts_by_what_was_verified():
    lengths = AdaptiveDraftLength(8)
    lengths.observe("a", 3, 3)  # all 3 verified drafts kept: doubles from 8, stays 8
    assert lengths.length("a") == 8
    lengths.observe("a", 0, 0)  # nothing verified: nothing learned
    assert lengths.length("a") == 8


def test_max_length_must_be_positive():
    with pytest.raises(ValueError, match="max_length must be at least 1, got 0"):
        AdaptiveDraftLength(0)


def test_the_scheduler_shortens_failing_drafts_and_restores_them_when_they_pass():
    def model(request, token_ids):  # off the period for output tokens 2-5, then on it again
        if request.num_prompt_tokens + 1 <= len(token_ids) <= request.num_prompt_tokens + 4:
            return 0
        return _periodic_model(request, token_ids)

    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3
    )
    scheduler = make_scheduler(speculative_config=config)
    scheduler.add_request(make_request("a", _periodic_prompt(10), max_tokens=60))
    step(scheduler, model)  # the prompt
    lengths = []
    for _ in range(12):
        output, _ = step(scheduler, model)
        lengths.append(len(output.scheduled_spec_decode_tokens.get("a", [])))
        if "a" not in scheduler.requests:
            break
    # The first 4 drafts are rejected (-> 2); while the model writes its 0s the drafts drawn from
    # them fail or are missing (-> 1); once it is back on the period they pass (1 -> 2 -> 4).
    assert lengths == [4, 0, 1, 1, 2, 4, 4, 4, 4, 4, 4, 4]
    assert scheduler.drafter.draft_length.length("a") == 4
    assert set(scheduler.requests["a"].output_token_ids[6:]) <= set(PERIOD)


def test_suffix_decoding_keeps_its_own_draft_lengths():
    scheduler = make_scheduler(speculative_config=SpeculativeConfig(method="suffix"))
    assert scheduler.drafter.draft_length is None
