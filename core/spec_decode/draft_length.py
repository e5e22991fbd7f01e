"""`AdaptiveDraftLength`: how many n-gram drafts each request gets, from how its last ones did."""

from __future__ import annotations


class AdaptiveDraftLength:
    """Per request, the most draft tokens its next step may verify.

    A verified draft costs a position of the forward whether or not it is accepted, and a
    request's acceptance runs in streaks: a reply that copies its prompt accepts every draft
    for dozens of tokens, then writes text of its own and accepts none. So a request starts at
    `max_length` (`num_speculative_tokens`); a draft of which no token was accepted halves its
    length (at least 1), a draft accepted in full doubles it (at most `max_length`), a partly
    accepted one keeps it. Output is unchanged by construction: only how many tokens are
    guessed changes, never which tokens are kept.
    """

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        self.max_length = max_length
        self._lengths: dict[str, int] = {}

    def length(self, request_id: str) -> int:
        return self._lengths.get(request_id, self.max_length)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Records one verified draft of `num_drafts` tokens, `num_accepted` of them kept."""
        if num_drafts <= 0:
            return
        length = self.length(request_id)
        if num_accepted == 0:
            length = max(1, length // 2)
        elif num_accepted >= num_drafts:
            length = min(self.max_length, length * 2)
        self._lengths[request_id] = length

    def remove(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._lengths)
