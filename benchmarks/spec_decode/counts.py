"""`SpecDecodeCounts`: what speculative decoding did during one run, from counter deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeCounts:
    """Cumulative counters (vLLM's `spec_decode_*` metrics): request-steps that verified drafts,
    their draft tokens, the drafts accepted, and per draft position how many were accepted
    there. A run's counts are the counters after it minus the counters before it."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_stats(cls, stats) -> SpecDecodeCounts:
        """From the engine's `SchedulerStats`."""
        return cls(
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
            list(stats.spec_decode_num_accepted_tokens_per_pos),
        )

    @classmethod
    def from_json(cls, record: dict) -> SpecDecodeCounts:
        """From a peer's record with the four fields by name; ValueError naming a bad one."""
        counts = []
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            value = record.get(name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"spec_decode.{name} must be a count, got {value!r}")
            counts.append(value)
        per_pos = record.get("num_accepted_tokens_per_pos", [])
        if not isinstance(per_pos, list) or not all(isinstance(n, int) for n in per_pos):
            raise ValueError(f"spec_decode.num_accepted_tokens_per_pos must be counts: {per_pos!r}")
        return cls(*counts, per_pos)

    def minus(self, earlier: SpecDecodeCounts) -> SpecDecodeCounts:
        """What was counted since `earlier` (positions `earlier` lacks count from zero)."""
        per_pos = [
            count - (earlier.num_accepted_tokens_per_pos[pos]
                     if pos < len(earlier.num_accepted_tokens_per_pos) else 0)
            for pos, count in enumerate(self.num_accepted_tokens_per_pos)
        ]  # fmt: skip
        return SpecDecodeCounts(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            per_pos,
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts per draft token verified; None without drafts."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verifying request-step gained: 1 plus its accepted drafts, on average."""
        if self.num_drafts == 0:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    def to_json(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
