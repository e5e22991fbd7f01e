"""`CoreClient`: what `AsyncEngineClient` uses of the client of its engine core(s).

Two implement it: `AsyncCoreClient` (one core, `frontend.core_client`) and
`DataParallelCoreClient` (several, `frontend.data_parallel_client`), so the engine client works
the same over one core or several without asking which it holds.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    KVBlockMap,
    SchedulerStats,
)


class CoreClient(Protocol):
    """Contract: after `start()`, `ready` is the (first) core's `EngineReady`, and the queue that
    `add_request` returns receives that request's outputs in order, ending with a finished one
    (or an exception: `EngineDeadError`, or the error given to `abort`). Once the engine is dead,
    `is_dead` is true, `dead_reason` says why and `wait_until_dead` returns it. Every method runs
    on the event loop that ran `start()`."""

    ready: EngineReady | None
    dead_reason: str | None

    @property
    def is_dead(self) -> bool: ...

    async def start(self) -> None:
        """Starts (or connects to) the core(s) and waits until they are ready."""
        ...

    def add_request(
        self, request: EngineCoreRequest
    ) -> asyncio.Queue[EngineCoreOutput | Exception]:
        """Sends the request; its outputs arrive on the returned queue."""
        ...

    async def abort(self, request_ids: list[str], error: Exception | None = None) -> None:
        """Finishes the requests' queues now (with ABORT, or `error`) and frees them in the
        core; unknown or finished ids are ignored."""
        ...

    async def wait_until_dead(self) -> str: ...

    async def get_stats(self) -> SchedulerStats:
        """The engine's scheduler stats (summed over cores)."""
        ...

    async def get_stats_per_core(self) -> list[SchedulerStats]:
        """Each core's stats, in data-parallel rank order (one entry for one core)."""
        ...

    async def get_kv_block_maps(self) -> list[KVBlockMap]:
        """Each core's KV block map (`proto.KVBlockMap`), in data-parallel rank order."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """True if every core reset its prefix cache; False while requests hold KV blocks."""
        ...

    async def shutdown(self) -> None:
        """Stops what this client started. Idempotent."""
        ...
