"""`SpecDecodingStats`: cumulative counts of drafts verified and draft tokens accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """vLLM's spec-decode counters, cumulative since the scheduler started.

    `num_drafts`: request-steps that verified at least one draft token; `num_draft_tokens`:
    the draft tokens they verified; `num_accepted_tokens`: those the target model kept.
    `num_accepted_tokens_per_pos[i]`: drafts whose token at position i (0-based) was kept,
    which is also how many drafts had at least i + 1 tokens accepted.
    Invariant: `num_accepted_tokens == sum(num_accepted_tokens_per_pos)
    <= num_draft_tokens`.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Counts one request's verified draft; ValueError for counts no draft can have."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"a draft of {num_draft_tokens} tokens (at most {self.num_speculative_tokens}) "
                f"cannot have {num_accepted_tokens} accepted"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1
