"""`PrefixAwareRouter`: which engine core of a data-parallel engine serves each prompt.

Each core's prefix cache is mirrored here as a set of compact block hashes
(`common.block_hash`): the hashes of prompts routed to the core are added at once (the core will
cache them within a step or two, and a burst of prompts sharing a prefix must not wait for that),
and the core's `KVCacheEvents` add what it stored and remove what it evicted. The mirror is
bounded (least recently used hashes go first), so a hash the core never stored (its request was
aborted before its prefill) cannot pile up.

Load is counted here rather than reported by the cores: the frontend sees every request when it
is routed and every token as it comes back, so a burst routed within one step is already counted
(a core's report would lag a step behind). A request weighs its prompt plus the tokens it has
generated so far (the KV it holds), until it finishes.

The choice: the core that would finish the prompt soonest, estimated as its load plus the prompt
tokens it still has to compute (those past the longest run of leading blocks it holds). So a
cached prefix wins while its core is not busier by more than the prefix saves, and unrelated
prompts go to the least loaded core. Ties go to the core chosen least recently.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from core_engine.common.block_hash import compact_block_hash, prompt_block_hashes
from core_engine.proto import KVCacheEvents


class CoreCacheMirror:
    """The compact hashes one core holds (as far as this frontend knows), most recent last."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache mirror needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, compact_hash: int) -> bool:
        return compact_hash in self._hashes

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's blocks, in order) are held, counted from the first."""
        for index, compact_hash in enumerate(hashes):
            if compact_hash not in self._hashes:
                return index
        return len(hashes)

    def add(self, hashes: Sequence[int]) -> None:
        for compact_hash in hashes:
            self._hashes[compact_hash] = None
            self._hashes.move_to_end(compact_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def remove(self, hashes: Sequence[int]) -> None:
        for compact_hash in hashes:
            self._hashes.pop(compact_hash, None)

    def clear(self) -> None:
        self._hashes.clear()


class PrefixAwareRouter:
    """Chooses a core per prompt and keeps each core's cache mirror and load.

    Not thread-safe: the frontend's event loop calls it.
    """

    def __init__(self, num_cores: int, block_size: int, seed: bytes, capacity: int) -> None:
        """`seed`: the cores' block hash seed; `capacity`: most hashes mirrored per core."""
        if num_cores < 1:
            raise ValueError(f"a router needs at least one core, got {num_cores}")
        self.block_size = block_size
        self.seed = seed
        self.mirrors = [CoreCacheMirror(capacity) for _ in range(num_cores)]
        self.load_tokens = [0] * num_cores
        self._last_chosen = [-1] * num_cores  # the decision number that last chose each core
        self._num_decisions = 0

    @property
    def num_cores(self) -> int:
        return len(self.mirrors)

    def block_hashes(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """The compact hashes of the prompt's full blocks, as its core will cache them for a
        request with `cache_salt` (`SamplingParams.cache_salt`) running with the LoRA adapter
        named `lora_name` (None: the base model)."""
        hashes = prompt_block_hashes(
            prompt_token_ids, self.block_size, self.seed, cache_salt, lora_name
        )
        return [compact_block_hash(block_hash) for block_hash in hashes]

    def choose(self, hashes: Sequence[int], num_prompt_tokens: int) -> int:
        """The core for a prompt of `num_prompt_tokens` tokens whose full blocks hash to
        `hashes`; does not record anything (see `route`)."""

        def cost(core: int) -> tuple[int, int]:
            cached_tokens = self.mirrors[core].matched_blocks(hashes) * self.block_size
            return self.load_tokens[core] + num_prompt_tokens - cached_tokens, self._last_chosen[
                core
            ]

        return min(range(self.num_cores), key=cost)

    def route(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Chooses the prompt's core and records it there: its blocks (keyed by `cache_salt`
        and the LoRA adapter's name) as (soon) cached, its tokens as load. Call `finished` with
        the same core when the request ends."""
        hashes = self.block_hashes(prompt_token_ids, cache_salt, lora_name)
        core = self.choose(hashes, len(prompt_token_ids))
        self.mirrors[core].add(hashes)
        self.load_tokens[core] += len(prompt_token_ids)
        self._last_chosen[core] = self._num_decisions
        self._num_decisions += 1
        return core

    def generated(self, core: int, num_tokens: int) -> None:
        """A request on `core` generated `num_tokens` more tokens (they hold KV there too)."""
        self.load_tokens[core] += num_tokens

    def finished(self, core: int, num_tokens: int) -> None:
        """A request on `core` ended; `num_tokens` is all the load it was counted for."""
        self.load_tokens[core] -= num_tokens

    def apply_events(self, core: int, events: KVCacheEvents) -> None:
        """Updates `core`'s mirror with what it reported (cleared, removed, then stored)."""
        mirror = self.mirrors[core]
        if events.cleared:
            mirror.clear()
        mirror.remove(events.removed)
        mirror.add(events.stored)
