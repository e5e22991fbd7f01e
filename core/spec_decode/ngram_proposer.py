"""`NgramProposer`: vLLM's prompt lookup ("ngram") over each request's own tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_engine.core.request import Request


@dataclass(slots=True)
class NgramIndex:
    """The earliest start of every n-gram (`min_n <= n <= max_n`) of one growing sequence.

    Invariant: `first_start[g]` is the smallest i with `tokens[i:i + len(g)] == g` among the
    first `num_indexed` tokens; tokens are only ever appended, so an entry never changes once
    set. Extending by one token costs `max_n - min_n + 1` dict operations, and a lookup
    as many: no search over the history per step.
    """

    min_n: int
    max_n: int
    first_start: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0

    def extend(self, token_ids: list[int]) -> None:
        """Indexes the n-grams ending in `token_ids[num_indexed:]` (the tokens added since)."""
        first_start = self.first_start
        for end in range(self.num_indexed + 1, len(token_ids) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_start.setdefault(tuple(token_ids[end - n : end]), end - n)
        self.num_indexed = len(token_ids)

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Up to `max_num_tokens` tokens that followed the longest n-gram ending the sequence
        that also occurs earlier in it (at its earliest occurrence, as vLLM's NgramProposer
        picks: its KMP search keeps the leftmost of the longest matches); [] when none does."""
        self.extend(token_ids)
        num_tokens = len(token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = self.first_start.get(tuple(token_ids[num_tokens - n :]))
            if start is not None and start < num_tokens - n:
                return token_ids[start + n : start + n + max_num_tokens]
        return []


class NgramProposer:
    """Prompt lookup: for n from `max_n` down to `min_n`, the last n tokens of the request
    (prompt and output) are looked up earlier in the same request; the first n that matches
    proposes the tokens that followed its earliest occurrence (vLLM's choice: its KMP
    search picks the leftmost of the longest matches). A match may overlap the suffix itself
    (a repeating pattern drafts its own continuation).

    One `NgramIndex` per request, built on its first proposal and extended by the tokens
    appended since, dropped by `remove_request`.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram window must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(request.all_token_ids, max_num_tokens)

    def remove_request(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._indexes)
