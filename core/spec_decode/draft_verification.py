"""What the scheduler does with a verified draft: check the worker's answer, roll back the
rejected positions; and the between-steps invariants of speculative decoding."""

from __future__ import annotations

from collections.abc import Iterable

from core_engine.core.request import Request
from core_engine.core.spec_decode.spec_decoding_stats import SpecDecodingStats


def roll_back_rejected_drafts(
    request: Request, drafts: list[int], sampled_token_ids: list[int]
) -> int:
    """Uncomputes the positions after the accepted drafts (their KV is overwritten next step)
    and returns how many drafts were accepted. The worker must return the accepted drafts, in
    order, then one more token; anything else is a worker fault (RuntimeError), since keeping it
    would leave KV in the cache for tokens the request does not have."""
    num_accepted = len(sampled_token_ids) - 1
    if num_accepted > len(drafts) or sampled_token_ids[:num_accepted] != drafts[:num_accepted]:
        raise RuntimeError(
            f"request {request.request_id!r} verified drafts {drafts} but the worker "
            f"returned {sampled_token_ids}: expected an accepted prefix of the drafts "
            "and one token after it"
        )
    request.num_computed_tokens -= len(drafts) - num_accepted
    return num_accepted


def check_spec_decode_integrity(requests: Iterable[Request], stats: SpecDecodingStats) -> None:
    """Between steps: no request holds drafts, none has more tokens computed than it has, and
    the accepted drafts never outnumber the drafted ones. Raises AssertionError."""
    for request in requests:
        assert not request.spec_token_ids, f"{request} holds drafts between steps"
        assert request.num_computed_tokens <= request.num_tokens, f"{request} computed drafts"
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
