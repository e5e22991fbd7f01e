"""`SuffixIndex`: the occurrences of recent token patterns in a set of sequences, answering
the queries of suffix decoding's depth-limited suffix tree without building one."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Anchors, longest first: every occurrence of the last 5 and of the last 2 tokens is indexed,
# each anchor keeping its `cap` most recent occurrences. A long match is found through its
# 5-token anchor however common its last tokens are; short ones are judged on recent text
# only, and a single matching token proposes nothing (its drafts are rarely accepted).
ANCHOR_LENGTHS_AND_CAPS = ((5, 64), (2, 16))

Occurrence = tuple[int, int]  # (sequence id, index of the occurrence's last token)


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    """A proposed continuation and its score: the sum over its tokens of each one's estimated
    probability (the product of count ratios along the path), i.e. the expected number of
    draft tokens accepted."""

    token_ids: list[int]
    score: float
    match_length: int


NO_DRAFT = SuffixDraft([], 0.0, 0)


@dataclass(frozen=True, slots=True)
class SpeculationLimits:
    """How far a draft may go: `max_tree_depth` bounds match plus draft, `max_spec_factor`
    the draft by its match length, `max_num_tokens` in absolute terms; `min_token_prob` stops
    the draft at the first token whose path probability falls below it."""

    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    max_num_tokens: int


class SuffixIndex:
    """Sequences (lists that may grow in place) and an index from each anchor (the last 1 or
    4 tokens ending at a position) to its most recent occurrences.

    A node of a suffix tree of depth D over these sequences is a pattern of at most D tokens;
    its count is its number of occurrences and a child's count the occurrences followed by
    that child's token. `speculate` computes those counts over the occurrences it finds
    through the anchors (for a pattern of at least 2 tokens), so it needs memory per token,
    not per token and depth (a Python trie of depth 24 over a 2k-token prompt holds ~45k
    nodes).
    Invariant: every indexed occurrence names a live sequence and a position below
    `num_indexed[sequence id]`.
    """

    def __init__(self) -> None:
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()
        self._num_indexed: dict[int, int] = {}
        self._anchors: dict[tuple[int, ...], list[Occurrence]] = {}

    def __len__(self) -> int:
        return len(self._sequences)

    def add_sequence(self, sequence_id: int, token_ids: list[int]) -> None:
        """Indexes `token_ids` (kept by reference: `extend_sequence` indexes what is appended)."""
        if sequence_id in self._sequences:
            raise ValueError(f"sequence {sequence_id} is already indexed")
        self._sequences[sequence_id] = token_ids
        self._num_indexed[sequence_id] = 0
        self.extend_sequence(sequence_id)

    def extend_sequence(self, sequence_id: int) -> None:
        """Indexes the tokens appended to the sequence since it was last indexed."""
        token_ids = self._sequences[sequence_id]
        anchors = self._anchors
        for end in range(self._num_indexed[sequence_id], len(token_ids)):
            for length, cap in ANCHOR_LENGTHS_AND_CAPS:
                if end + 1 < length:
                    continue
                occurrences = anchors.setdefault(tuple(token_ids[end + 1 - length : end + 1]), [])
                occurrences.append((sequence_id, end))
                if len(occurrences) > cap:
                    del occurrences[0]
        self._num_indexed[sequence_id] = len(token_ids)

    def pop_oldest_sequence(self) -> None:
        """Forgets the sequence added first, and its occurrences."""
        sequence_id, token_ids = self._sequences.popitem(last=False)
        del self._num_indexed[sequence_id]
        for length, _ in ANCHOR_LENGTHS_AND_CAPS:
            for end in range(length - 1, len(token_ids)):
                key = tuple(token_ids[end + 1 - length : end + 1])
                occurrences = self._anchors.get(key)
                if occurrences is None:
                    continue
                occurrences[:] = [o for o in occurrences if o[0] != sequence_id]
                if not occurrences:
                    del self._anchors[key]

    def speculate(self, context: list[int], limits: SpeculationLimits) -> SuffixDraft:
        """The best-scoring draft over every match length: for each length m of a suffix of
        `context` found in the sequences (2 <= m < max_tree_depth), the greedy walk from its
        node (most frequent child first) for at most min(max_num_tokens, m * max_spec_factor,
        max_tree_depth - m) tokens while the path probability stays >= min_token_prob.
        Ties go to the longer match.

        Anchors are visited longest first, each adding its occurrences and the match lengths
        from its own length up to the previous anchor's; the shorter ones are skipped once
        the best draft scores what their shorter matches could at most."""
        best = NO_DRAFT
        found: dict[Occurrence, int] = {}
        longer_anchor = limits.max_tree_depth
        for anchor_length, _ in ANCHOR_LENGTHS_AND_CAPS:
            ceiling = min(limits.max_num_tokens, (longer_anchor - 1) * limits.max_spec_factor)
            if best.score >= ceiling:
                break
            self._find_occurrences(context, anchor_length, limits.max_tree_depth - 1, found)
            match_lengths = {m for m in found.values() if anchor_length <= m < longer_anchor}
            for match_length in sorted(match_lengths, reverse=True):
                best = self._better_draft(found, match_length, limits, best)
            longer_anchor = anchor_length
        return best

    def _better_draft(
        self,
        found: dict[Occurrence, int],
        match_length: int,
        limits: SpeculationLimits,
        best: SuffixDraft,
    ) -> SuffixDraft:
        """The draft from the node of the context's last `match_length` tokens, if it
        scores above `best`; else `best`."""
        max_num_tokens = min(
            limits.max_num_tokens,
            int(match_length * limits.max_spec_factor),
            limits.max_tree_depth - match_length,
        )
        if max_num_tokens <= best.score:  # cannot beat the best: each token scores <= 1
            return best
        occurrences = [o for o, m in found.items() if m >= match_length]
        draft = self._greedy_walk(occurrences, max_num_tokens, limits.min_token_prob)
        if draft.score > best.score:
            return SuffixDraft(draft.token_ids, draft.score, match_length)
        return best

    def _find_occurrences(
        self, context: list[int], anchor_length: int, max_match: int, found: dict[Occurrence, int]
    ) -> None:
        """Adds to `found` each indexed occurrence of the context's last `anchor_length`
        tokens that some token follows, with how many tokens (up to `max_match`) of the
        context's end it matches."""
        if len(context) < anchor_length:
            return
        for occurrence in self._anchors.get(tuple(context[-anchor_length:]), ()):
            sequence_id, end = occurrence
            token_ids = self._sequences[sequence_id]
            if end + 1 < len(token_ids) and occurrence not in found:
                found[occurrence] = _match_length(token_ids, end, context, max_match)

    def _greedy_walk(
        self, occurrences: list[Occurrence], max_num_tokens: int, min_token_prob: float
    ) -> SuffixDraft:
        token_ids: list[int] = []
        probability = 1.0
        score = 0.0
        while len(token_ids) < max_num_tokens and occurrences:
            children: dict[int, list[Occurrence]] = {}
            for sequence_id, end in occurrences:
                sequence = self._sequences[sequence_id]
                if end + 1 < len(sequence):
                    children.setdefault(sequence[end + 1], []).append((sequence_id, end + 1))
            if not children:
                break
            token_id, followers = max(children.items(), key=lambda item: len(item[1]))
            probability *= len(followers) / len(occurrences)
            if probability < min_token_prob:
                break
            token_ids.append(token_id)
            score += probability
            occurrences = followers
        return SuffixDraft(token_ids, score, 0)


def _match_length(token_ids: list[int], end: int, context: list[int], max_match: int) -> int:
    """How many tokens ending at `token_ids[end]` equal the last ones of `context` (at most
    `max_match`); the full length is checked first, as copying makes it the common case."""
    limit = min(max_match, end + 1, len(context))
    if token_ids[end + 1 - limit : end + 1] == context[len(context) - limit :]:
        return limit
    length = 0
    while length < limit and token_ids[end - length] == context[-1 - length]:
        length += 1
    return length
