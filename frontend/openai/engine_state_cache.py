"""`EngineStateCache`: the answer of GET /engine/state, shared for a short while."""

from __future__ import annotations

import asyncio
import time

from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.data_parallel_client import sum_stats
from core_engine.frontend.openai.protocol.engine_state import EngineState


class EngineStateCache:
    """Asks the core(s) for stats and block maps at most once per `max_age_s`, however many
    pages poll: callers within that time, or waiting on the call in flight, share its answer.
    Once the engine is dead, raises the engine client's `EngineDeadError`."""

    def __init__(self, model: str, max_age_s: float = 0.5) -> None:
        self.model = model
        self.max_age_s = max_age_s
        self._state: EngineState | None = None
        self._fetched_at_s = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self, engine: AsyncEngineClient) -> EngineState:
        async with self._lock:
            if self._state is None or time.monotonic() - self._fetched_at_s >= self.max_age_s:
                self._state = await self._fetch(engine)
                self._fetched_at_s = time.monotonic()
            return self._state

    async def _fetch(self, engine: AsyncEngineClient) -> EngineState:
        per_core, block_maps = await asyncio.gather(
            engine.get_stats_per_core(), engine.get_kv_block_maps()
        )
        return EngineState.of(self.model, time.time(), sum_stats(per_core), block_maps)
