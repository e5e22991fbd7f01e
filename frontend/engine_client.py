"""`EngineClient`: the synchronous twin of `AsyncEngineClient`, for code without an event loop.

An event loop (uvloop when installed) runs in a background daemon thread and owns the
`AsyncEngineClient`; every call hands a coroutine to that loop and waits for its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from core_engine.frontend.async_engine_client import AsyncEngineClient, Prompt
from core_engine.frontend.request_output import RequestOutput
from core_engine.proto import LoRARequest, SamplingParams, SchedulerStats
from core_engine.proto.engine_config import EngineConfig

T = TypeVar("T")
SIGNAL_CHECK_INTERVAL_S = 0.1  # how long a Ctrl-C may wait for the main thread to notice


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EngineClient:
    """Starts (or connects to) an engine and serves it from any thread.

    Contract: same semantics as `AsyncEngineClient`; `generate` returns a plain iterator whose
    request is aborted when the iterator is closed or garbage-collected before it finishes.
    `shutdown` (or leaving the `with` block) stops the engine and the loop thread; it is
    idempotent.
    """

    def __init__(
        self, config: EngineConfig, address: str | None = None, tokenizer: Any = None
    ) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-client-loop", daemon=True
        )
        self._thread.start()
        self._is_shut_down = False
        try:
            self.engine = self.run(_start_engine(config, address, tokenizer))
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine on the engine's loop and returns (or raises) its result. Interrupted
        (Ctrl-C's KeyboardInterrupt), it cancels the coroutine, which aborts its requests: the
        engine does not go on computing what nobody waits for, and stays usable."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            # In slices: a SIGINT the kernel hands to another thread (it may, when the main
            # thread has a signal pending) only runs its handler, in this thread, once this
            # thread runs Python again; an unbounded wait would not return until the end.
            while not future.done():
                concurrent.futures.wait([future], timeout=SIGNAL_CHECK_INTERVAL_S)
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream: bool = True,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Validates now (raising `ValueError`), then iterates like `AsyncEngineClient.generate`."""
        outputs = self.engine.generate(
            prompt,
            sampling_params,
            request_id,
            stream=stream,
            priority=priority,
            lora_request=lora_request,
        )
        return self._iterate(outputs)

    def abort(self, request_id: str) -> None:
        self.run(self.engine.abort(request_id))

    def check_health(self) -> None:
        self.run(self.engine.check_health())

    def get_stats(self) -> SchedulerStats:
        return self.run(self.engine.get_stats())

    def reset_prefix_cache(self) -> bool:
        return self.run(self.engine.reset_prefix_cache())

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        try:
            self.run(self.engine.shutdown())
        finally:
            self._stop_loop()

    def _iterate(self, outputs: Any) -> Iterator[RequestOutput]:
        try:
            while True:
                try:
                    yield self.run(outputs.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running():
                self.run(outputs.aclose())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _start_engine(
    config: EngineConfig, address: str | None, tokenizer: Any
) -> AsyncEngineClient:
    engine = AsyncEngineClient(config, address, tokenizer)
    try:
        await engine.start()
    except BaseException:
        await engine.shutdown()
        raise
    return engine
