"""What the scheduler does with a verified draft: check the worker's answer, roll back the
rejected positions."""

from __future__ import annotations

from core_engine.core.request import Request


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
