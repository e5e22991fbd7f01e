"""A core seen exited is declared dead only once its last words (EngineDead, which says why)
have had LAST_WORDS_WAIT_S to arrive: its process can be seen gone before the message it sent
on its way out has crossed ZeroMQ's I/O threads (the SIGTERM e2e test met this under load)."""

from __future__ import annotations

import asyncio

from core_engine.frontend import core_client
from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.proto.engine_config import EngineConfig

GONE = "engine core process 1 exited (exit code 0)"
LAST_WORDS = "engine core was stopped by SIGTERM"


def watched_client(monkeypatch, last_words_after_s: float | None) -> AsyncCoreClient:
    """A client whose core is gone from the start, its outputs replaced by the core's last
    words arriving `last_words_after_s` after the first check (None: never)."""
    client = AsyncCoreClient(EngineConfig(device="cpu"))
    loop = asyncio.get_running_loop()
    first_read = []

    def read_outputs():
        if not first_read:
            first_read.append(loop.time())
        if last_words_after_s is not None and loop.time() - first_read[0] >= last_words_after_s:
            client.mark_dead(LAST_WORDS)

    monkeypatch.setattr(client, "_read_outputs", read_outputs)
    monkeypatch.setattr(client, "_core_gone_reason", lambda: GONE)
    return client


async def dead_reason_after(client: AsyncCoreClient, bound_s: float) -> str | None:
    client._check_core()
    deadline = asyncio.get_running_loop().time() + bound_s
    while not client.is_dead and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    if client._liveness_timer is not None:
        client._liveness_timer.cancel()
    return client.dead_reason


def test_last_words_arriving_after_the_exit_give_the_reason(monkeypatch):
    async def scenario():
        client = watched_client(monkeypatch, last_words_after_s=core_client.POLL_INTERVAL_S)
        client._check_core()
        assert not client.is_dead  # seen gone, but its last words may be on their way
        assert await dead_reason_after(client, 10) == LAST_WORDS

    asyncio.run(scenario())


def test_without_last_words_the_exit_is_the_reason_after_the_wait(monkeypatch):
    async def scenario():
        client = watched_client(monkeypatch, last_words_after_s=None)
        start = asyncio.get_running_loop().time()
        assert await dead_reason_after(client, 10) == GONE
        assert asyncio.get_running_loop().time() - start >= core_client.LAST_WORDS_WAIT_S

    asyncio.run(scenario())
