"""`TierIndex`: which block hashes one offloading tier holds, in which slot, least recently used
first. The scheduler side keeps it, so a lookup needs no round trip to the workers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from core_engine.common.block_hash import BlockHash


class TierIndexIntegrityError(RuntimeError):
    """An invariant of a tier index does not hold: a bug, never a user error."""


class TierIndex:
    """Block hash -> slot in a tier of `capacity` slots (slot s is the worker's host block s, or,
    for the disk tier, just a place in its budget).

    Invariants: every slot in [0, capacity) is either free or held by exactly one hash; a pinned
    hash is held. Eviction takes the least recently used hash that is not pinned: pins protect
    the slots a step's transfers read or write until the workers report the step.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier needs at least 1 block of capacity, got {capacity}")
        self.capacity = capacity
        self._hash_to_slot: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[BlockHash] = set()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hash_to_slot

    def __len__(self) -> int:
        return len(self._hash_to_slot)

    def get_slot(self, block_hash: BlockHash) -> int | None:
        """The hash's slot, without touching it."""
        return self._hash_to_slot.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """Marks a held hash most recently used."""
        self._hash_to_slot.move_to_end(block_hash)

    def allocate(self, block_hash: BlockHash) -> tuple[int, BlockHash | None] | None:
        """A slot for a hash not held yet, most recently used, and the hash evicted to free it
        (None if a slot was free). None when every slot is held by a pinned hash: a full tier
        evicts, never blocks, and stores nothing it cannot place."""
        if block_hash in self._hash_to_slot:
            raise TierIndexIntegrityError(f"hash {block_hash.hex()} is already held")
        evicted = None
        if not self._free_slots:
            evicted = self._least_recent_unpinned()
            if evicted is None:
                return None
            self._free_slots.append(self._hash_to_slot.pop(evicted))
        slot = self._free_slots.pop()
        self._hash_to_slot[block_hash] = slot
        return slot, evicted

    def _least_recent_unpinned(self) -> BlockHash | None:
        for block_hash in self._hash_to_slot:
            if block_hash not in self._pinned:
                return block_hash
        return None

    def remove(self, block_hash: BlockHash) -> int | None:
        """Forgets a hash (e.g. its file turned out bad); returns the slot it freed."""
        slot = self._hash_to_slot.pop(block_hash, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._pinned.discard(block_hash)
        return slot

    def pin(self, block_hash: BlockHash) -> None:
        if block_hash not in self._hash_to_slot:
            raise TierIndexIntegrityError(f"cannot pin hash {block_hash.hex()}: not held")
        self._pinned.add(block_hash)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def add_oldest_first(self, block_hashes: Iterable[BlockHash]) -> None:
        """Takes hashes a tier already holds (a disk tier from an earlier run), least recently
        used first, up to capacity (later ones win: the oldest are dropped from the index)."""
        for block_hash in block_hashes:
            if block_hash in self._hash_to_slot:
                self.touch(block_hash)
            elif self.allocate(block_hash) is None:
                raise TierIndexIntegrityError("a fresh tier has pinned hashes")

    def hashes_lru_first(self) -> list[BlockHash]:
        return list(self._hash_to_slot)

    def check_integrity(self) -> None:
        slots = list(self._hash_to_slot.values())
        held = set(slots)
        if len(held) != len(slots):
            raise TierIndexIntegrityError("a slot is held by two hashes")
        if held & set(self._free_slots) or len(held) + len(self._free_slots) != self.capacity:
            raise TierIndexIntegrityError(
                f"{len(held)} held and {len(self._free_slots)} free slots do not make up "
                f"capacity {self.capacity} exactly"
            )
        if not self._pinned <= set(self._hash_to_slot):
            raise TierIndexIntegrityError("a pinned hash is not held")
