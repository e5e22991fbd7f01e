"""`Drafter`: each decoding request's draft tokens for the next step, within the limits."""

from __future__ import annotations

from typing import Protocol

from core_engine.core.request import Request
from core_engine.core.spec_decode.draft_length import AdaptiveDraftLength
from core_engine.core.spec_decode.ngram_proposer import NgramProposer
from core_engine.core.spec_decode.suffix_proposer import SuffixProposer
from core_engine.proto.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    """Drafts from a request's tokens; may keep per-request state until `remove_request`."""

    def propose(self, request: Request, max_num_tokens: int) -> list[int]: ...

    def remove_request(self, request: Request) -> None: ...


class Drafter:
    """Sets `Request.spec_token_ids` of the running requests before a step is scheduled.

    A request gets drafts only while decoding: its prompt (and, after a preemption, its
    recomputation) done, so that only its last sampled token is uncomputed; never in the
    step that computes the last token of its prompt. Drafts never reach
    past a limit: at most `num_speculative_tokens`, and at most one token fewer than the
    request may still generate (the step samples one token after the accepted drafts), by
    `max_tokens` and by `max_model_len`. No request gets drafts in a step whose running batch
    holds `disable_by_batch_size` requests or more. With n-gram drafts a request's limit also
    follows its acceptance (`AdaptiveDraftLength`, fed by `observe_verification`); suffix
    decoding sizes each draft from its match already.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_speculative_tokens = config.num_lookahead_tokens
        self.proposer = make_proposer(config)
        self.draft_length = (
            AdaptiveDraftLength(self.num_speculative_tokens) if config.method == "ngram" else None
        )

    def propose_drafts(self, running: list[Request]) -> None:
        """Replaces every running request's drafts (none for those that may not draft)."""
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) < limit
        for request in running:
            max_num_tokens = self.max_num_draft_tokens(request) if enabled else 0
            request.spec_token_ids = (
                self.proposer.propose(request, max_num_tokens) if max_num_tokens > 0 else []
            )

    def max_num_draft_tokens(self, request: Request) -> int:
        """How many drafts `request` may verify next step (0 while it is not decoding)."""
        if request.num_output_tokens == 0 or request.num_computed_tokens != request.num_tokens - 1:
            return 0  # a prompt (or its last chunk) still to compute
        num_left = self.max_model_len - request.num_tokens
        if request.max_tokens is not None:
            num_left = min(num_left, request.max_tokens - request.num_output_tokens)
        limit = self.num_speculative_tokens
        if self.draft_length is not None:
            limit = self.draft_length.length(request.request_id)
        return max(0, min(limit, num_left - 1))

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """What the last step's verification of `request`'s drafts kept."""
        if self.draft_length is not None:
            self.draft_length.observe(request.request_id, num_drafts, num_accepted)

    def remove_request(self, request: Request) -> None:
        """Drops what the proposer keeps for a finished request (suffix decoding caches its
        output for later requests) and the request's draft length."""
        self.proposer.remove_request(request)
        if self.draft_length is not None:
            self.draft_length.remove(request.request_id)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(*config.ngram_window)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")
