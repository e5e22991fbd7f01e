"""A long prompt tokenized on a worker thread leaves the event loop free: the tokenizer runs
without the GIL, so a server keeps answering /health and streaming while it works."""

from __future__ import annotations

import asyncio
import time

from core_engine.common.model_files import default_model_path
from core_engine.frontend.text.tokenizer import load_tokenizer


def test_tokenizing_on_a_thread_does_not_hold_the_event_loop():
    tokenizer = load_tokenizer(default_model_path())
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # about 900 kB

    async def scenario() -> tuple[float, float, list[int]]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        token_ids = await asyncio.to_thread(tokenizer.encode, text)
        elapsed = time.perf_counter() - start
        task.cancel()
        return elapsed, max(gaps), token_ids

    elapsed, longest_gap, token_ids = asyncio.run(scenario())
    assert token_ids == tokenizer.backend.encode(text).ids
    # Held GIL: one gap as long as the whole encode. Released: ticks keep coming.
    assert longest_gap < elapsed / 4, (longest_gap, elapsed)
