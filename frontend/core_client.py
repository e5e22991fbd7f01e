"""`AsyncCoreClient`: the frontend's asyncio handle on one engine core process.

The client binds ROUTER (requests, aborts, utility calls; the core's `EngineReady` arrives here
too and names the core's routing id) and PULL (outputs, utility answers, `EngineDead`), in a
private 0700 ipc directory or on a given tcp address, then launches `python -m core_engine.core` (or waits
for one started by hand: "attach"). Outputs are dispatched into per-request queues by a reader
callback on the PULL socket's file descriptor, which reads with plain non-blocking calls: no
future, timer or reader registration per poll and per message, as awaiting zmq.asyncio calls
costs. A timer checks the core's liveness every POLL_INTERVAL_S.

Attach: a core started by hand serves one client after another. It connects to whichever client
binds its address and greets each with `EngineReady`; the client watches its ROUTER's
connections (a socket monitor) to tell "no core has connected yet" (a warning after
NO_CORE_WARNING_S, `EngineCoreNotFoundError` after `startup_timeout_s`) from "a core connected
and is still starting" (the launched core's start-up bound), and to notice the core leaving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from core_engine.common.config_error import ConfigError
from core_engine.frontend.core_process import CoreLauncher, CoreProcess, LocalCoreLauncher
from core_engine.frontend.request_output import RequestOutput
from core_engine.proto import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    FinishReason,
    KVBlockMap,
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    SchedulerStats,
    UtilityMethod,
    UtilityRequest,
    UtilityResponse,
)
from core_engine.proto.endpoints import PRIVATE_IPC_DIR_PREFIX, frontend_endpoints
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# Messages dispatched per reader callback before yielding to the event loop.
MAX_MESSAGES_PER_READ = 1024
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
# Attach: how long no core may have connected before the client says so.
NO_CORE_WARNING_S = 5.0
# How long a core seen gone may take to deliver what it sent before it went.
LAST_WORDS_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine core is gone; the message says why. Every later call raises it too.

    `outputs`: what the requests it ended had produced by then, one final-shaped
    `RequestOutput` each (whole text and token ids so far, unfinished choices marked "error"),
    in the order the caller submitted them; empty where no request was cut off (a call made
    after the death, a utility call).
    """

    def __init__(self, reason: str, outputs: Sequence[RequestOutput] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.outputs = list(outputs)


class EngineCoreNotFoundError(TimeoutError):
    """Attach: no engine core connected to the client's address in time; the message names
    the address and the command that starts a core there."""


class AsyncCoreClient:
    """Sends requests to one engine core and routes its outputs to per-request queues (a
    `CoreClient`).

    Contract: after `start()`, the queue returned by `add_request` receives that request's
    `EngineCoreOutput`s in order and then nothing more once one is finished (STOP, LENGTH,
    ERROR, or the ABORT that `abort` puts there itself); or an `EngineDeadError` if the core
    dies first. Every method must be called on the event loop that ran `start()`.
    `launch_core=False` waits for a core started separately with
    `python -m core_engine.core --frontend-address ADDRESS` (`address` is then required), which may have
    served other clients before this one and serves the next one after it.
    `env`: the launched core's environment (None: this process's). `on_outputs` sees every
    `EngineCoreOutputs` before its outputs are dispatched (a data-parallel router counts load
    and reads the core's KV cache events there). `label` prefixes the reasons of its death
    ("engine core 1 of 2"). `launcher` starts the core (default: `python -m core_engine.core` as this
    process's child; see `frontend.core_process`).
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        *,
        launch_core: bool = True,
        env: dict[str, str] | None = None,
        on_outputs: Callable[[EngineCoreOutputs], None] | None = None,
        label: str | None = None,
        launcher: CoreLauncher | None = None,
    ) -> None:
        if address is None and not launch_core:
            raise ValueError("launch_core=False needs the address the engine core connects to")
        if address is not None:
            frontend_endpoints(address)  # validates it now, not after start-up work
        self.config = config
        self.address = address
        self.launch_core = launch_core
        self.env = env
        self.on_outputs = on_outputs
        self.label = label
        self.launcher = launcher or LocalCoreLauncher()
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self._context: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.Socket | None = None  # a plain socket, read from the reader callback
        self._output_decoder = MessageDecoder(
            [EngineCoreOutputs, UtilityResponse, EngineDead], config.max_frame_bytes
        )
        self._liveness_timer: asyncio.TimerHandle | None = None  # set once dispatching starts
        self._core_routing_id: bytes | None = None
        self._process: CoreProcess | None = None
        self._ipc_dir: str | None = None
        self._core_connected = False  # attach: a core's connection was seen
        self._warned_no_core = False
        self._core_disconnected = False
        self._core_gone_since: float | None = None  # loop time the core was first seen gone
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._request_id_to_queue: dict[str, asyncio.Queue[EngineCoreOutput | Exception]] = {}
        self._call_id_to_future: dict[int, asyncio.Future[UtilityResponse]] = {}
        self._call_ids = itertools.count()
        self._encoder = MessageEncoder()
        self._is_shut_down = False
        self._died = asyncio.Event()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def core_pid(self) -> int | None:
        """The pid of the core this client launched (None for a core started separately)."""
        return self._process.pid if self._process is not None else None

    @property
    def core_process(self) -> CoreProcess | None:
        """The core this client launched (None for a core started separately)."""
        return self._process

    # ---- start-up --------------------------------------------------------------------------

    async def start(self) -> None:
        """Binds, launches the core, waits for `EngineReady` (bounded), starts dispatching.

        Raises EngineDeadError if the core dies or reports failure during start-up, ConfigError
        if the engine cannot run with its settings (the message names the setting), and
        TimeoutError if it does not become ready in time; either way nothing is left behind.
        """
        if self._context is not None:
            raise RuntimeError("AsyncCoreClient.start() was already called")
        self._context = zmq.asyncio.Context()
        try:
            self._bind_sockets(self.address or self._make_private_ipc_address())
            if self.launch_core:
                self._process = self._launch_core()
            else:
                self._watch_core_connection()
            self.ready = await self._wait_for_ready()
        except BaseException:
            await self.shutdown()
            raise
        logger.info("connected to the engine core at %s", self.address)
        self._start_dispatching()

    def _make_private_ipc_address(self) -> str:
        self._ipc_dir = tempfile.mkdtemp(prefix=PRIVATE_IPC_DIR_PREFIX)
        os.chmod(self._ipc_dir, 0o700)
        return f"ipc://{self._ipc_dir}/engine"

    def _bind_sockets(self, address: str) -> None:
        self.address = address
        endpoints = frontend_endpoints(address)
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished core raises, not drops
        if not self.launch_core:
            self._router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
            self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._router.bind(endpoints.requests)
        self._pull = zmq.Context.shadow(self._context.underlying).socket(zmq.PULL)
        self._pull.bind(endpoints.outputs)

    def _launch_core(self) -> CoreProcess:
        process = self.launcher.launch(self.address, self.config, self.env)
        where = f"pid {process.pid}" if process.pid is not None else "placed by its launcher"
        logger.info("launched engine core (%s) at %s", where, self.address)
        return process

    def _watch_core_connection(self) -> None:
        """A core we did not launch is watched through its connection instead of its pid: its
        arrival (a finished handshake) and its departure, which ends this client's engine."""
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        self._monitor = self._router.get_monitor_socket(events)

        async def watch() -> None:
            while True:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if self.ready is None:
                        logger.info("an engine core connected at %s", self.address)
                    self._core_connected = True
                    continue
                logger.warning("engine core connection closed: %s", event)
                self._core_disconnected = True
                return

        self._tasks.append(asyncio.create_task(watch(), name="core-connection"))

    async def _wait_for_ready(self) -> EngineReady:
        """The core's `EngineReady`, waited for up to 2 x startup_timeout_s + shutdown_timeout_s
        (the core waits up to startup_timeout_s for model loading and again for allocation);
        attached, up to startup_timeout_s for a core to connect at all."""
        timeout_s = 2 * self.config.startup_timeout_s + self.config.shutdown_timeout_s
        ready_decoder = MessageDecoder([EngineReady], self.config.max_frame_bytes)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout_s
        while (remaining_s := deadline - loop.time()) > 0:
            if await self._router.poll(min(remaining_s, POLL_INTERVAL_S) * 1000):
                routing_id, *frames = await self._router.recv_multipart()
                try:
                    ready = ready_decoder.decode(frames)
                except MessageDecodeError as exc:
                    logger.warning("ignored a malformed frame while waiting for ready: %s", exc)
                    continue
                self._core_routing_id = routing_id
                return ready
            self._read_outputs_before_ready()
            if (reason := self._core_gone_reason()) is not None:
                # Its last words (EngineDead) may still be on their way: they say more.
                self._read_outputs_before_ready(LAST_WORDS_WAIT_S)
                raise EngineDeadError(f"{reason} during start-up")
            if not self.launch_core and not self._core_connected:
                self._check_no_core_wait(loop.time() - start)
        raise TimeoutError(f"engine core at {self.address} was not ready within {timeout_s} s")

    def _read_outputs_before_ready(self, wait_s: float = 0.0) -> None:
        """Raises EngineDeadError on the core's `EngineDead` (ConfigError when the engine cannot
        start with its settings). Outputs before `EngineReady` were meant for an earlier client
        of the same core: they are dropped. Waits up to `wait_s` for the first frame."""
        while self._pull.poll(wait_s * 1000):
            wait_s = 0.0
            try:
                message = self._output_decoder.decode(self._pull.recv_multipart())
            except MessageDecodeError as exc:
                logger.warning("ignored a malformed frame while waiting for ready: %s", exc)
                continue
            if isinstance(message, EngineDead) and message.is_config_error:
                raise ConfigError(message.reason)
            if isinstance(message, EngineDead):
                raise EngineDeadError(f"engine core failed to start: {message.reason}")
            logger.debug("dropped %s meant for an earlier client", type(message).__name__)

    def _check_no_core_wait(self, waited_s: float) -> None:
        """Attach, while no core has connected: a warning once NO_CORE_WARNING_S have passed,
        EngineCoreNotFoundError once startup_timeout_s have."""
        start_one = f"start one with `python -m core_engine.core --frontend-address {self.address} --model ...`"
        if waited_s >= self.config.startup_timeout_s:
            raise EngineCoreNotFoundError(
                f"no engine core connected to {self.address} within startup_timeout_s="
                f"{self.config.startup_timeout_s:g} s; {start_one} (the engine flags that count "
                "are the core's)"
            )
        if waited_s >= NO_CORE_WARNING_S and not self._warned_no_core:
            logger.warning(
                "no engine core has connected to %s after %.0f s; %s; waiting up to %g s",
                self.address,
                waited_s,
                start_one,
                self.config.startup_timeout_s,
            )
            self._warned_no_core = True

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self, request: EngineCoreRequest
    ) -> asyncio.Queue[EngineCoreOutput | Exception]:
        """Registers the request's queue, then sends the request. Raises EngineDeadError, or
        ValueError if the id is already in flight."""
        self._raise_if_dead()
        if request.request_id in self._request_id_to_queue:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        output_queue: asyncio.Queue[EngineCoreOutput | Exception] = asyncio.Queue()
        self._request_id_to_queue[request.request_id] = output_queue
        try:
            self._send(request)
        except BaseException:
            self._request_id_to_queue.pop(request.request_id, None)
            raise
        return output_queue

    async def abort(self, request_ids: list[str], error: Exception | None = None) -> None:
        """Finishes the requests' queues now, with ABORT (or `error`, raised to their readers),
        and tells the core to free them.

        Unknown or finished ids are ignored; a no-op once the engine is dead.
        """
        for request_id in request_ids:
            output_queue = self._request_id_to_queue.pop(request_id, None)
            if output_queue is not None:
                ending = error or EngineCoreOutput(request_id, [], FinishReason.ABORT)
                output_queue.put_nowait(ending)
        if self.ready is not None and not self.is_dead and request_ids:
            await self._send(AbortRequests(list(request_ids)))

    async def wait_until_dead(self) -> str:
        """Returns the reason once the engine is dead (at once if it already is)."""
        await self._died.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    async def get_stats(self) -> SchedulerStats:
        response = await self._call_utility(UtilityMethod.GET_STATS)
        return response.stats

    async def get_stats_per_core(self) -> list[SchedulerStats]:
        """One core: its stats, as the one entry."""
        return [await self.get_stats()]

    async def get_kv_block_maps(self) -> list[KVBlockMap]:
        """One core: its KV block map, as the one entry."""
        response = await self._call_utility(UtilityMethod.GET_KV_BLOCK_MAP)
        return [response.kv_block_map]

    async def reset_prefix_cache(self) -> bool:
        """True if the prefix cache was reset; False while requests hold KV blocks."""
        response = await self._call_utility(UtilityMethod.RESET_PREFIX_CACHE)
        return response.error is None

    async def _call_utility(self, method: UtilityMethod) -> UtilityResponse:
        self._raise_if_dead()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._call_id_to_future[call_id] = future
        try:
            await self._send(UtilityRequest(call_id, method))
            return await asyncio.wait_for(future, self.config.step_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"engine core did not answer {method} within {self.config.step_timeout_s} s"
            ) from None
        finally:
            self._call_id_to_future.pop(call_id, None)

    def _send(self, message: msgspec.Struct) -> asyncio.Future:
        """Queues `message` to the core; raises EngineDeadError at once if it is unreachable."""
        frames = [self._core_routing_id, *self._encoder.encode(message)]
        future = self._router.send_multipart(frames, copy=False)
        if future.done() and future.exception() is not None:
            self._die(f"engine core is unreachable: {future.exception()}")
            self._raise_if_dead()
        return future

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.ready is None:
            raise RuntimeError("AsyncCoreClient.start() has not completed")

    # ---- outputs ---------------------------------------------------------------------------

    def _start_dispatching(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pull.FD, self._read_outputs)
        self._liveness_timer = loop.call_later(POLL_INTERVAL_S, self._check_core)
        self._read_outputs()  # the fd signals changes only: read what arrived before

    def _read_outputs(self) -> None:
        """Dispatches the messages waiting on the PULL. The zmq fd is edge-triggered, so this
        reads until none is left, or reschedules itself after MAX_MESSAGES_PER_READ."""
        try:
            for _ in range(MAX_MESSAGES_PER_READ):
                # Checking EVENTS (which also re-arms the fd) is cheaper than zmq.Again.
                if self.is_dead or not self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = self._pull.recv_multipart(copy=False)
                try:
                    message = self._output_decoder.decode([frame.buffer for frame in frames])
                except MessageDecodeError as exc:
                    logger.warning("ignored a malformed frame from the engine core: %s", exc)
                    continue
                self._dispatch(message)
            asyncio.get_running_loop().call_soon(self._read_outputs)
        except Exception as exc:
            logger.exception("engine core output dispatch failed")
            self._die(f"engine core output dispatch failed: {exc}")

    def _check_core(self) -> None:
        """Every POLL_INTERVAL_S: outputs the core sent before dying are delivered first, then
        a core that is gone marks the client dead, once its last words (EngineDead, which says
        why) have had LAST_WORDS_WAIT_S to arrive: the process can be seen exited before the
        message it sent on its way out has crossed ZeroMQ's I/O threads."""
        self._read_outputs()
        if not self.is_dead and (reason := self._core_gone_reason()) is not None:
            now = asyncio.get_running_loop().time()
            if self._core_gone_since is None:
                self._core_gone_since = now
            if now - self._core_gone_since >= LAST_WORDS_WAIT_S:
                self._die(reason)
        if not self.is_dead:
            loop = asyncio.get_running_loop()
            self._liveness_timer = loop.call_later(POLL_INTERVAL_S, self._check_core)

    def _dispatch(self, message: msgspec.Struct) -> None:
        if isinstance(message, EngineCoreOutputs):
            if self.on_outputs is not None:
                self.on_outputs(message)
            for output in message.outputs:
                if output.finished:
                    output_queue = self._request_id_to_queue.pop(output.request_id, None)
                else:
                    output_queue = self._request_id_to_queue.get(output.request_id)
                if output_queue is not None:  # None: aborted here already
                    output_queue.put_nowait(output)
        elif isinstance(message, UtilityResponse):
            future = self._call_id_to_future.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            self._die(f"engine core died: {message.reason}")

    def _core_gone_reason(self) -> str | None:
        if self._process is not None and (reason := self._process.exit_reason()) is not None:
            return reason
        if self._core_disconnected:
            return f"engine core at {self.address} disconnected"
        return None

    def _die(self, reason: str) -> None:
        """`mark_dead` for a reason this client found, prefixed with its `label` if any."""
        self.mark_dead(f"{self.label}: {reason}" if self.label else reason)

    def mark_dead(self, reason: str) -> None:
        """Fails every pending queue and call with EngineDeadError(reason); first reason wins."""
        if self.dead_reason is not None:
            return
        logger.log(
            logging.INFO if self._is_shut_down else logging.ERROR, "engine is dead: %s", reason
        )
        self.dead_reason = reason
        self._died.set()
        if self._process is not None and not self._is_shut_down:
            # A core that reported its death exits on its own: reap it (no zombie), killing it
            # if it outlives its shutdown bound.
            self._tasks.append(asyncio.get_running_loop().create_task(self._stop_core_process()))
        for output_queue in self._request_id_to_queue.values():
            output_queue.put_nowait(EngineDeadError(reason))
        self._request_id_to_queue.clear()
        for future in self._call_id_to_future.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._call_id_to_future.clear()

    # ---- shutdown --------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """SIGTERM the core, SIGKILL it if it outlives its own shutdown bound; close sockets,
        remove the ipc directory. Pending queues get EngineDeadError. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._stop_dispatching()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._process is not None:
            await self._stop_core_process()
        self.mark_dead("the engine client was shut down")
        if self._monitor is not None:
            self._router.disable_monitor()
        for sock in (self._monitor, self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._context is not None:
            self._context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _stop_dispatching(self) -> None:
        if self._liveness_timer is None:
            return
        self._liveness_timer.cancel()
        self._liveness_timer = None
        asyncio.get_running_loop().remove_reader(self._pull.FD)

    async def _stop_core_process(self) -> None:
        # The core stops its workers within about 2 * shutdown_timeout_s, then flushes.
        await asyncio.to_thread(self._process.stop, 3 * self.config.shutdown_timeout_s + 1.0)
