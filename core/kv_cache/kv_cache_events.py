"""`KVCacheEventLog`: which prefix blocks an engine core's cache gained and lost since the last
report, for a data-parallel frontend that routes prompts to the core holding their prefix.

Only the first KV cache group is logged (full attention on every model with groups: a core holds
a prefix when that group does). A hash is logged as stored when it enters the pool's map and as
removed when its last block leaves it; a reset of the prefix cache is one `cleared` event.
Hashes are compact (`compact_block_hash`): 8 bytes each on the wire.
"""

from __future__ import annotations

from core_engine.common.block_hash import compact_block_hash
from core_engine.proto import KVCacheEvents

LOGGED_GROUP_ID = 0


class KVCacheEventLog:
    """Collects events between two `take()` calls; `take()` returns them and starts anew."""

    def __init__(self) -> None:
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._cleared = False

    def record_stored(self, block_hash: bytes) -> None:
        self._stored.append(compact_block_hash(block_hash))

    def record_removed(self, block_hash: bytes) -> None:
        self._removed.append(compact_block_hash(block_hash))

    def record_cleared(self) -> None:
        """Every cached hash is gone: earlier events of this report no longer matter."""
        self._stored.clear()
        self._removed.clear()
        self._cleared = True

    def take(self) -> KVCacheEvents | None:
        """The events since the last call (in order: cleared, then removed, then stored), or
        None when there were none."""
        if not (self._stored or self._removed or self._cleared):
            return None
        events = KVCacheEvents(self._stored, self._removed, self._cleared)
        self._stored, self._removed, self._cleared = [], [], False
        return events
