"""`SuffixProposer`: suffix decoding (Arctic Inference's method, as vLLM's "suffix")."""

from __future__ import annotations

import itertools

from core_engine.core.request import Request
from core_engine.core.spec_decode.suffix_index import SpeculationLimits, SuffixIndex
from core_engine.proto.speculative_config import SpeculativeConfig


class SuffixProposer:
    """Drafts from two indexes and keeps the better-scoring draft (the request's own on a tie):
    one per request over its prompt and output, and a global one over the outputs of the
    `suffix_decoding_max_cached_requests` requests that finished last (the oldest forgotten
    first; 0: none kept). The pattern is the last `suffix_decoding_max_tree_depth - 1` tokens
    of the request; see `SuffixIndex.speculate` for the draft's length and probability rules.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_tree_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self._request_indexes: dict[str, SuffixIndex] = {}
        self.global_index = SuffixIndex()
        self._sequence_ids = itertools.count()

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        limits = SpeculationLimits(
            self.max_tree_depth, self.max_spec_factor, self.min_token_prob, max_num_tokens
        )
        context = request.all_token_ids
        own_draft = self._request_index(request).speculate(context, limits)
        global_draft = self.global_index.speculate(context, limits)
        best = global_draft if global_draft.score > own_draft.score else own_draft
        return best.token_ids

    def _request_index(self, request: Request) -> SuffixIndex:
        index = self._request_indexes.get(request.request_id)
        if index is None:
            index = self._request_indexes[request.request_id] = SuffixIndex()
            index.add_sequence(0, request.all_token_ids)
        else:
            index.extend_sequence(0)
        return index

    def remove_request(self, request: Request) -> None:
        """Drops the request's index and caches its output in the global index."""
        self._request_indexes.pop(request.request_id, None)
        if self.max_cached_requests == 0 or request.num_output_tokens == 0:
            return
        self.global_index.add_sequence(next(self._sequence_ids), list(request.output_token_ids))
        while len(self.global_index) > self.max_cached_requests:
            self.global_index.pop_oldest_sequence()

    @property
    def num_tracked_requests(self) -> int:
        return len(self._request_indexes)
