"""Reading the engine's output streams of one HTTP request: interleaved as they arrive
(`merge_outputs`), or their final outputs (`final_outputs`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from core_engine.frontend.openai.api_error import request_failed_error
from core_engine.frontend.request_output import RequestOutput


async def merge_outputs(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as (stream index, output), as outputs arrive.

    Closing (or cancelling) the merged iterator cancels every stream, which aborts their
    unfinished requests in the engine.
    """
    if len(streams) == 1:  # most requests: read directly, no task and queue hop per output
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    """Closes `stream` now (its cleanup aborts an unfinished request), not whenever the
    garbage collector gets to it; a finished stream's close does nothing."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each non-streamed request, in order; 500 if the engine failed one."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merge_outputs(streams):
        finals[index] = output
    for final in finals:
        assert final is not None and final.finished
        if (error := request_failed_error(final)) is not None:
            raise error
    return finals  # type: ignore[return-value]
