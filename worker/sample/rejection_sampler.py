"""`RejectionSampler`: verifies a request's draft tokens against the target model in one step.

A request verifying K drafts d_1..d_K has K + 1 consecutive logits rows: row j (0-based) holds the
target's logits after its history extended by d_1..d_j, already masked for that position (a
grammar) and with sampling metadata describing that extended history (penalties, min_tokens, bad
words). Every row goes through the same logits processing as `Sampler`, so each position's
target distribution p_j is exactly the one one-at-a-time decoding would sample from there.

Verification walks j = 1..K and stops at the first rejected draft:
- greedy (temperature 0): d_j is accepted iff it is the argmax of row j - 1; the returned tokens
  are the accepted drafts, then the argmax of the row where the first mismatch stood (or of row
  K, the bonus token, after all K were accepted), i.e. exactly the greedy tokens;
- random: d_j is accepted with probability p_{j-1}(d_j); a rejected draft is replaced by a draw
  from p_{j-1} with d_j's mass removed (renormalised); after K accepted drafts the bonus token
  is drawn from p_K. For deterministic drafts (a draft distribution q that puts all its mass on
  d) this is the standard speculative rule (accept with min(1, p/q), resample from
  max(0, p - q)), so each returned token has the distribution one-at-a-time sampling gives it.
A seeded request draws its acceptance uniforms, then its replacement or bonus token, from its
own generator only, so its output depends on its seed, logits and drafts, not on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core_engine.common.math_utils import concatenated_ranges
from core_engine.proto import TokenLogprobs
from core_engine.worker.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logits_processors,
    gather_logprobs,
    greedy_token_ids,
    raw_logprobs_if_needed,
    target_probs,
)


@dataclass(slots=True)
class RejectionSamplerOutput:
    """Per request: 1..K+1 `token_ids` (the accepted drafts, then one token sampled where the
    first rejected draft stood, or the bonus token), and `logprobs` one per token iff the
    request asked for them."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


@dataclass(slots=True)
class _DraftLayout:
    """Where each request's rows and drafts lie: request i owns logits rows
    `row_starts[i] .. row_starts[i] + num_drafts[i]`; its drafts are `draft_ids[draft_starts[i]:
    draft_starts[i] + num_drafts[i]]`, verified at rows `draft_rows` of the same slice."""

    num_drafts: np.ndarray  # int64 [N]
    row_starts: np.ndarray  # int64 [N]
    draft_starts: np.ndarray  # int64 [N]
    draft_ids: np.ndarray  # int64 [D]
    draft_rows: np.ndarray  # int64 [D]

    @staticmethod
    def of(draft_token_ids: Sequence[Sequence[int]]) -> _DraftLayout:
        num_drafts = np.array([len(d) for d in draft_token_ids], dtype=np.int64)
        row_starts = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]]).astype(np.int64)
        draft_starts = np.concatenate([[0], np.cumsum(num_drafts)[:-1]]).astype(np.int64)
        num_total = int(num_drafts.sum())
        draft_rows = np.repeat(row_starts - draft_starts, num_drafts) + np.arange(num_total)
        draft_ids = np.fromiter(
            (t for drafts in draft_token_ids for t in drafts), dtype=np.int64, count=num_total
        )
        return _DraftLayout(num_drafts, row_starts, draft_starts, draft_ids, draft_rows)


class RejectionSampler:
    """Accepts the drafts the target agrees with and samples one more token per request, through
    `sampler`'s logits processing and generators (see the module docstring for the rule)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: Sequence[Sequence[int]],
    ) -> RejectionSamplerOutput:
        """`logits` [R, vocab] and `metadata` (R rows) hold request i's 1 + len(draft_token_ids[i])
        rows consecutively, in request order; all rows of a request share its generator and
        logprobs count. A request with no drafts is sampled exactly as `Sampler` samples it."""
        num_drafts = sum(len(drafts) for drafts in draft_token_ids)
        num_rows = num_drafts + len(draft_token_ids)
        if logits.shape[0] != num_rows:
            raise ValueError(
                f"{len(draft_token_ids)} requests with {num_drafts} drafts need {num_rows} "
                f"logits rows, got {logits.shape[0]}"
            )
        if num_drafts == 0:
            output = self.sampler(logits, metadata)
            return RejectionSamplerOutput(
                token_ids=[[t] for t in output.sampled_token_ids.tolist()],
                logprobs=[None if lp is None else [lp] for lp in output.logprobs],
            )
        layout = _DraftLayout.of(draft_token_ids)
        logits = logits.float()
        raw_logprobs = raw_logprobs_if_needed(logits, metadata)
        logits = apply_logits_processors(logits, metadata)
        is_greedy = metadata.temperature == 0.0
        probs = None if metadata.get_flags().all_greedy else target_probs(logits, metadata)
        num_accepted = self._num_accepted(logits, probs, is_greedy, metadata, layout)
        final_tokens = self._final_tokens(logits, probs, is_greedy, metadata, layout, num_accepted)
        return _assemble(raw_logprobs, metadata, layout, num_accepted, final_tokens)

    def _num_accepted(
        self,
        logits: torch.Tensor,
        probs: torch.Tensor | None,
        is_greedy: torch.Tensor,
        metadata: SamplingMetadata,
        layout: _DraftLayout,
    ) -> np.ndarray:
        """Per request, the length of its run of accepted drafts (0..K)."""
        rows = torch.from_numpy(layout.draft_rows).to(logits.device)
        draft_ids = torch.from_numpy(layout.draft_ids).to(logits.device)
        accepted = greedy_token_ids(logits[rows]) == draft_ids
        if probs is not None:
            u = self.sampler.uniform(len(layout.draft_ids), _draft_spans(metadata, layout))
            randomly_accepted = u < probs[rows, draft_ids]
            accepted = torch.where(is_greedy[rows], accepted, randomly_accepted)
        accepted_flags = accepted.cpu().numpy()
        num_accepted = np.empty(len(layout.num_drafts), dtype=np.int64)
        for i, (start, count) in enumerate(
            zip(layout.draft_starts.tolist(), layout.num_drafts.tolist(), strict=True)
        ):
            rejected = np.flatnonzero(~accepted_flags[start : start + count])
            num_accepted[i] = rejected[0] if len(rejected) else count
        return num_accepted

    def _final_tokens(
        self,
        logits: torch.Tensor,
        probs: torch.Tensor | None,
        is_greedy: torch.Tensor,
        metadata: SamplingMetadata,
        layout: _DraftLayout,
        num_accepted: np.ndarray,
    ) -> torch.Tensor:
        """Per request, the token at the row after its accepted run: the argmax for greedy rows;
        for random ones a draw from that row's distribution without the rejected draft (none
        removed for the bonus row)."""
        final_rows_np = layout.row_starts + num_accepted
        final_rows = torch.from_numpy(final_rows_np).to(logits.device)
        tokens = greedy_token_ids(logits[final_rows])
        if probs is None:
            return tokens
        residual = probs[final_rows]
        was_rejected = np.flatnonzero(num_accepted < layout.num_drafts)
        if len(was_rejected):
            first_rejected = layout.draft_starts[was_rejected] + num_accepted[was_rejected]
            index = torch.from_numpy(np.stack([was_rejected, layout.draft_ids[first_rejected]]))
            residual[tuple(index.to(residual.device))] = 0.0
        generators = {
            i: metadata.generators[row]
            for i, row in enumerate(layout.row_starts.tolist())
            if row in metadata.generators
        }
        random_tokens = self.sampler.random_sample(residual, generators)
        return torch.where(is_greedy[final_rows], tokens, random_tokens)


def _draft_spans(
    metadata: SamplingMetadata, layout: _DraftLayout
) -> dict[tuple[int, int], torch.Generator]:
    """The slice of the draft positions each seeded request's uniforms fill."""
    spans = {}
    for row, start, count in zip(
        layout.row_starts.tolist(),
        layout.draft_starts.tolist(),
        layout.num_drafts.tolist(),
        strict=True,
    ):
        generator = metadata.generators.get(row)
        if generator is not None and count:
            spans[(start, start + count)] = generator
    return spans


def _assemble(
    raw_logprobs: torch.Tensor | None,
    metadata: SamplingMetadata,
    layout: _DraftLayout,
    num_accepted: np.ndarray,
    final_tokens: torch.Tensor,
) -> RejectionSamplerOutput:
    """Each request's accepted drafts plus its final token, and the logprobs of each returned
    token from the row that produced it."""
    token_ids = []
    for i, final in enumerate(final_tokens.tolist()):
        start = int(layout.draft_starts[i])
        token_ids.append([*layout.draft_ids[start : start + num_accepted[i]].tolist(), final])
    if raw_logprobs is None:
        return RejectionSamplerOutput(token_ids, [None] * len(token_ids))
    counts = num_accepted + 1
    returned_rows = np.repeat(layout.row_starts, counts) + concatenated_ranges(counts)
    returned = torch.tensor([t for tokens in token_ids for t in tokens], dtype=torch.int64)
    entries = gather_logprobs(
        raw_logprobs[torch.from_numpy(returned_rows).to(raw_logprobs.device)],
        returned.to(raw_logprobs.device),
        [metadata.num_logprobs[row] for row in returned_rows.tolist()],
    )
    logprobs: list[list[TokenLogprobs] | None] = []
    offset = 0
    for count in counts.tolist():
        request_entries = entries[offset : offset + count]
        offset += count
        logprobs.append(None if request_entries[0] is None else list(request_entries))
    return RejectionSamplerOutput(token_ids, logprobs)
