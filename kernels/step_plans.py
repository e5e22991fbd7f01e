"""`StepPlans`: what the attention backends derive from one step's metadata, built once.

Every layer of a step attends over the same requests, so the backend for the cache's device and
each backend's work plan (which requests go to which kernel, their tiles) are the same for all
of them. The first layer builds them; the others find them here. One `StepPlans` belongs to one
`AttentionMetadata` and is dropped with it at the end of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class StepPlans:
    """Memo of one step's derived plans, keyed by what they depend on besides the metadata
    (the backend, the cache's block size and dtype, a sliding window)."""

    __slots__ = ("_key_to_plan",)

    def __init__(self) -> None:
        self._key_to_plan: dict[Hashable, object] = {}

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """`build()` for the first caller with `key` this step, the same object after."""
        plan = self._key_to_plan.get(key)
        if plan is None:
            plan = self._key_to_plan[key] = build()
        return plan  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._key_to_plan)
