"""`EngineCoreProc`: the engine core process around `EngineCore`.

One thread, one poll loop, owned here: it waits on the frontend's DEALER and on every worker's
pipe at once. While idle, a frame from the frontend or a worker's exit wakes it; while the workers
run a step, it keeps reading the DEALER (decoding requests and building their block hashes
overlaps the model, as an input thread would, without the thread hand-offs that input and
output threads cost) until rank 0's answer arrives. The executor only sends and receives.
Outputs are encoded and sent on the PUSH right after each step. Malformed frames are answered
with an ERROR output for their request and never stop the loop.

Life cycle: start workers -> KV sizing handshake -> serve clients until a signal (exit 0,
`EngineDead` sent) or a failure (`EngineDead` with the reason, which fails every request the
client has in flight; exit 1).

Clients, one after another (see `ClientWatch`): every frontend that connects gets `EngineReady`
on the DEALER as soon as the engine is ready (at once if it already is). When the client
departs, the core aborts every request it holds (their KV blocks are freed, no output is sent)
and drops the departed client's unread frames and unsent outputs, so that the next client starts
from an idle engine and hears nothing meant for another. The DEALER is IMMEDIATE: a message goes
only to a live connection, never into a queue the next client would read.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time

import msgspec
import zmq

from core_engine.common.config_error import ConfigError
from core_engine.core.client_watch import ClientEvent, ClientWatch
from core_engine.core.engine_core import (
    EngineCore,
    make_error_output,
    make_outputs,
    make_request,
    start_engine_core,
)
from core_engine.core.executor.executor import PollableExecutor, WorkerFailedError
from core_engine.core.executor.executor_factory import make_executor
from core_engine.core.kv_cache.kv_cache_events import KVCacheEventLog
from core_engine.core.lora_adapter_check import LoRAAdapterCheck
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler
from core_engine.core.step_trace import StepTrace
from core_engine.proto import (
    AbortRequests,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    ModelRunnerOutput,
    SchedulerOutput,
    UtilityMethod,
    UtilityRequest,
    UtilityResponse,
)
from core_engine.proto.codec import TYPE_TO_CODE
from core_engine.proto.endpoints import frontend_endpoints
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
OUTPUT_LINGER_MS = 2000
# Frames decoded per read of the DEALER, so a flood of requests cannot starve a step.
MAX_FRAMES_PER_READ = 4096

InputItem = Request | AbortRequests | UtilityRequest


class ShutdownRequested(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT; unwinds to a clean shutdown."""


class EngineCoreProc:
    """Runs one engine core process; `run()` returns the process exit code."""

    def __init__(self, config: EngineConfig, frontend_address: str) -> None:
        self.config = config
        self.frontend_address = frontend_address
        self.context = zmq.Context()
        self.endpoints = frontend_endpoints(frontend_address)
        self.input_socket = self.context.socket(zmq.DEALER)
        self.input_socket.setsockopt(zmq.ROUTING_ID, f"core-{os.getpid()}".encode())
        self.input_socket.setsockopt(zmq.IMMEDIATE, 1)
        self.client_watch = ClientWatch(self.input_socket)
        self.input_socket.connect(self.endpoints.requests)
        self.output_socket = self._connect_output_socket()
        self.pending_inputs: collections.deque[InputItem] = collections.deque()
        self.encoder = MessageEncoder()
        # The size limit is the decoder's, not zmq.MAXMSGSIZE: on a connecting socket an
        # oversized message would cut the link to the frontend for good (no reconnect).
        self.decoder = MessageDecoder(
            [EngineCoreRequest, AbortRequests, UtilityRequest], config.max_frame_bytes
        )
        self.poller = zmq.Poller()  # the DEALER and every worker's pipe (see _run_busy_loop)
        self.executor: PollableExecutor | None = None
        self.engine_core: EngineCore | None = None
        self.kv_event_log: KVCacheEventLog | None = None  # data parallelism only
        self.ready: EngineReady | None = None  # what every client is greeted with
        self.lora_check: LoRAAdapterCheck | None = None  # set with `ready`
        self.step_trace = StepTrace.from_env()  # CORE_ENGINE_STEP_TRACE: one line per step
        # Steps sent to the workers and not yet answered, oldest first, with when each was sent.
        self.steps_in_flight: collections.deque[tuple[SchedulerOutput, float]] = collections.deque()

    def run(self, launched_by_frontend: bool = False) -> int:
        """Serves until stopped (0) or failed (1). A core `launched_by_frontend` ignores SIGINT
        (a terminal's Ctrl-C reaches the whole process group, and the frontend, which drains its
        requests first, decides when its core stops, with SIGTERM) and leaves a config error
        for the frontend to report; started by hand, it stops on SIGINT and logs that error."""
        _install_signal_handlers(stop_on_sigint=not launched_by_frontend)
        start = time.monotonic()
        try:
            self.ready = self._start_engine()
            self.lora_check = LoRAAdapterCheck(self.ready.lora_target_shapes)
            elapsed_s = time.monotonic() - start
            logger.info(describe_ready(self.ready, elapsed_s, self.engine_core.scheduler))
            if self.config.speculative_config is not None:
                logger.info(self.config.speculative_config.describe())
            self._run_busy_loop()
        except ShutdownRequested as exc:
            logger.info("engine core shutting down on %s", exc)
            self._send(
                EngineDead(f"engine core was stopped by {exc}"), self.config.shutdown_timeout_s
            )
            return 0
        except ConfigError as exc:  # the user's to fix: one line, no traceback
            level = logging.DEBUG if launched_by_frontend else logging.ERROR
            logger.log(level, "engine core cannot start: %s", exc)
            self._send(EngineDead(str(exc), is_config_error=True), self.config.shutdown_timeout_s)
            return 1
        except Exception as exc:
            logger.exception("engine core failed")
            self._fail_unfinished_requests(f"engine core failed: {exc}")
            return 1
        finally:
            self._shutdown()
        return 0

    # ---- start-up --------------------------------------------------------------------------

    def _start_engine(self) -> EngineReady:
        """Starts the worker processes and runs the start-up handshake."""
        self.executor = make_executor(self.config)
        self.engine_core, ready = start_engine_core(self.config, self.executor)
        if self.config.data_parallel_size > 1:
            # The frontend routes by the cores' cached prefixes: report them with the outputs.
            self.kv_event_log = self.engine_core.scheduler.enable_kv_cache_events()
        return ready

    # ---- main thread: busy loop ------------------------------------------------------------

    def _run_busy_loop(self) -> None:
        """Applies inputs, plans and sends steps, applies their outputs and sends them to the
        client; forever (until an exception unwinds it).

        At most `max_steps_in_flight` steps are on the workers: one, or under async scheduling
        two, the next planned and queued while the workers run the last (only behind a step
        with tokens: an empty step, which may wait on a grammar, is answered before the next
        is planned). The workers answer steps in the order they were sent.
        """
        engine_core = self.engine_core
        self.poller.register(self.input_socket, zmq.POLLIN)
        self.poller.register(self.client_watch.monitor, zmq.POLLIN)
        for fd in self.executor.pipe_fds():
            self.poller.register(fd, zmq.POLLIN)
        max_steps_in_flight = 2 if self.config.async_scheduling else 1
        while True:
            self._read_frontend()
            self._handle_client_events()
            while self.pending_inputs:
                self._handle_input(self.pending_inputs.popleft())
            if len(self.steps_in_flight) < max_steps_in_flight:
                scheduler_output = engine_core.schedule_step()
                if scheduler_output is not None:
                    self._send_step(scheduler_output)
                    queue_another = scheduler_output.total_num_scheduled_tokens > 0
                    if queue_another and len(self.steps_in_flight) < max_steps_in_flight:
                        continue
            if not self.steps_in_flight:
                self._wait_for_frontend()
                continue
            self._finish_oldest_step()

    def _send_step(self, scheduler_output: SchedulerOutput) -> None:
        self.executor.send_step(scheduler_output)
        self.steps_in_flight.append((scheduler_output, time.monotonic()))

    def _finish_oldest_step(self) -> None:
        """Waits for the oldest step's output (reading the DEALER meanwhile, see
        `_wait_for_step`), applies it and sends the client its outputs."""
        scheduler_output, sent_s = self.steps_in_flight.popleft()
        model_output = self._wait_for_step()
        if self.step_trace is not None:
            self.step_trace.record(scheduler_output, sent_s, time.monotonic())
        outputs = self.engine_core.finish_step(scheduler_output, model_output)
        if self.kv_event_log is not None:
            outputs.kv_events = self.kv_event_log.take()
        if outputs.outputs or outputs.kv_events is not None:
            self._send(outputs)

    def _wait_for_frontend(self) -> None:
        """Blocks until the DEALER has a frame or a client arrives or departs. A worker's pipe
        turning readable meanwhile (its error report or its exit) raises WorkerFailedError at
        once; liveness is also re-checked every POLL_INTERVAL_S."""
        while True:
            ready = self.poller.poll(POLL_INTERVAL_S * 1000)
            if not ready:
                self.executor.check_alive()
            for source, _ in ready:
                if source is not self.input_socket and source is not self.client_watch.monitor:
                    raise self.executor.fail_on_message(source)
            if ready:
                return

    def _wait_for_step(self) -> ModelRunnerOutput:
        """Rank 0's answer to the oldest step in flight, reading the DEALER into `pending_inputs`
        meanwhile; WorkerFailedError if a worker fails or none answers within step_timeout_s."""
        timeout_s = self.config.step_timeout_s
        deadline = time.monotonic() + timeout_s
        while (remaining_s := deadline - time.monotonic()) > 0:
            ready = self.poller.poll(min(remaining_s, POLL_INTERVAL_S) * 1000)
            if not ready:
                self.executor.check_alive()
            for source, _ in ready:
                if source is self.input_socket:
                    self._read_frontend()
                elif source is self.client_watch.monitor:
                    self.client_watch.read_events()  # handled once the step is applied
                else:
                    return self.executor.receive_step_output(source)
        raise WorkerFailedError(f"no worker answered a step within {timeout_s} s")

    def _handle_input(self, item: InputItem) -> None:
        if isinstance(item, Request):
            error_output = self.engine_core.add_request(item)
            if error_output is not None:
                self._send(make_outputs([error_output]))
        elif isinstance(item, AbortRequests):
            self.engine_core.abort_requests(item.request_ids)
        else:
            self._send(self._call_utility(item))

    def _call_utility(self, call: UtilityRequest) -> UtilityResponse:
        if call.method is UtilityMethod.GET_STATS:
            return UtilityResponse(call.call_id, stats=self.engine_core.get_stats())
        if call.method is UtilityMethod.GET_KV_BLOCK_MAP:
            return UtilityResponse(call.call_id, kv_block_map=self.engine_core.get_kv_block_map())
        if call.method is UtilityMethod.RESET_PREFIX_CACHE and not (
            self.engine_core.reset_prefix_cache()
        ):
            return UtilityResponse(
                call.call_id, error="cannot reset the prefix cache while requests hold KV blocks"
            )
        return UtilityResponse(call.call_id)  # reset done, or a ping

    # ---- clients, one after another --------------------------------------------------------

    def _handle_client_events(self) -> None:
        """Departures abort what the departed client left; the client connected now, if it
        has just arrived, is greeted. Called between steps: a step still in flight (async
        scheduling) comes back with tokens for aborted requests only, which the scheduler
        drops, so nothing of the departed client's reaches the next."""
        self.client_watch.read_events()
        events = self.client_watch.take_events()
        for event in events:
            if event is ClientEvent.DEPARTED:
                self._forget_departed_client()
            else:
                logger.info("a frontend client connected at %s", self.frontend_address)
        if events and events[-1] is ClientEvent.ARRIVED:
            self._greet_client()

    def _greet_client(self) -> None:
        """Sends `EngineReady`, whose frame also tells the client the core's routing id."""
        # Reading EVENTS makes zmq attach the new connection's pipe now (its handshake event
        # came after the command that does so); a send alone may put that off for a while.
        self.input_socket.getsockopt(zmq.EVENTS)
        try:
            self.input_socket.send_multipart(self.encoder.encode(self.ready), flags=zmq.NOBLOCK)
        except zmq.Again:  # gone already: its departure is the next event
            logger.info("the frontend client at %s left before its greeting", self.frontend_address)

    def _forget_departed_client(self) -> None:
        """Everything the core holds belongs to the client that departed: it serves one at a
        time, and greets the next only after this. Its requests are aborted (KV blocks freed,
        no output sent), its unread frames dropped, and the outputs still queued for it are
        discarded with the PUSH socket, which reconnects for the next client."""
        self._drop_unread_frames()
        request_ids = self.engine_core.unfinished_request_ids()
        num_pending = sum(isinstance(item, Request) for item in self.pending_inputs)
        self.pending_inputs.clear()
        self.engine_core.abort_requests(request_ids)
        self.output_socket.close(linger=0)
        self.output_socket = self._connect_output_socket()
        num_aborted = len(request_ids) + num_pending
        requests = f"{num_aborted} request{'s' if num_aborted > 1 else ''}"
        aborted = f"aborted {requests} it had in flight (KV blocks freed)"
        logger.info(
            "the frontend client at %s departed%s; waiting for the next client",
            self.frontend_address,
            f": {aborted}" if num_aborted else "",
        )

    def _drop_unread_frames(self) -> None:
        while self.input_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.input_socket.recv_multipart(copy=False)

    # ---- frontend sockets ------------------------------------------------------------------

    def _connect_output_socket(self) -> zmq.Socket:
        socket = self.context.socket(zmq.PUSH)
        # A send waiting on a frontend that reads nothing returns every POLL_INTERVAL_S, so a
        # signal is still handled and a shutdown stays bounded (see _send).
        socket.setsockopt(zmq.SNDTIMEO, int(POLL_INTERVAL_S * 1000))
        socket.connect(self.endpoints.outputs)
        return socket

    def _read_frontend(self) -> None:
        """Decodes the frames waiting on the DEALER (up to MAX_FRAMES_PER_READ) into
        `pending_inputs`; never blocks. Also called while a step runs."""
        socket = self.input_socket
        for _ in range(MAX_FRAMES_PER_READ):
            # Checking EVENTS is cheaper than the zmq.Again exception of an empty recv.
            if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = socket.recv_multipart(copy=False)
            item = self._decode_input([frame.buffer for frame in frames])
            if item is not None:
                self.pending_inputs.append(item)

    def _decode_input(self, frames: list[memoryview]) -> InputItem | None:
        """The item for the busy loop, or None after answering/logging a bad frame."""
        try:
            message = self.decoder.decode(frames)
        except MessageDecodeError as exc:
            logger.warning("rejected a malformed frame from the frontend: %s", exc)
            request_id = _peek_request_id(frames, self.config.max_frame_bytes)
            if request_id is not None:
                self._send_error(request_id, f"malformed request: {exc}")
            return None
        if not isinstance(message, EngineCoreRequest):
            return message
        try:
            return make_request(message, self.ready, self.lora_check)
        except Exception as exc:
            logger.warning("rejected request %r: %s", message.request_id, exc)
            self._send_error(message.request_id, f"invalid request: {exc}")
            return None

    def _send_error(self, request_id: str, message: str) -> None:
        self._send(make_outputs([make_error_output(request_id, message)]))

    def _send(self, message: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Encodes and queues one message on the PUSH. At the high-water mark (a frontend that
        stopped reading) it waits: in normal operation for as long as the client stays
        connected, up to `timeout_s` when shutting down, after which the message is dropped with
        a warning."""
        frames = self.encoder.encode(message)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self.output_socket.send_multipart(frames, copy=False)
                return
            except zmq.Again:
                if deadline is None and not self._client_is_connected():
                    return  # its departure, handled next, discards what was queued for it
                if deadline is not None and time.monotonic() > deadline:
                    logger.warning(
                        "dropped %s: the frontend read nothing for %s s",
                        type(message).__name__,
                        timeout_s,
                    )
                    return

    def _client_is_connected(self) -> bool:
        self.client_watch.read_events()
        return self.client_watch.is_connected

    # ---- failure and shutdown --------------------------------------------------------------

    def _fail_unfinished_requests(self, reason: str) -> None:
        """`EngineDead(reason)`: the client fails every request it has in flight with it (no
        per-request ERROR output, which a client could not tell from one request's failure)."""
        _ignore_signals()
        self._send(EngineDead(reason), self.config.shutdown_timeout_s)

    def _shutdown(self) -> None:
        """Stops workers, flushes outputs (bounded), closes sockets. Ignores further signals."""
        _ignore_signals()
        if self.executor is not None:
            self.executor.shutdown()
        self.client_watch.close()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=OUTPUT_LINGER_MS)
        self.context.term()
        if self.step_trace is not None:
            self.step_trace.close()


def _install_signal_handlers(stop_on_sigint: bool) -> None:
    def handle(signum: int, frame: object) -> None:
        _ignore_signals()
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle if stop_on_sigint else signal.SIG_IGN)


def _ignore_signals() -> None:
    """From here on the process is already shutting down: a second signal must not cut it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _peek_request_id(frames: list[memoryview], max_frame_bytes: int) -> str | None:
    """The request id of a frame typed EngineCoreRequest whose fields failed validation."""
    if len(frames) != 2 or bytes(frames[0]) != TYPE_TO_CODE[EngineCoreRequest]:
        return None
    if len(frames[1]) > max_frame_bytes:
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def describe_ready(ready: EngineReady, start_s: float, scheduler: Scheduler) -> str:
    """The engine's start-up summary: its KV pool and how many requests it holds at full length
    (with KV cache groups, a token takes a block slot in every group it still needs)."""
    num_full_length = (ready.num_gpu_blocks - 1) // scheduler.num_blocks_per_full_length_request
    pool = f"{ready.num_gpu_blocks * ready.block_size} tokens"
    if scheduler.num_kv_cache_groups > 1:
        pool = (
            f"{scheduler.num_kv_cache_groups} KV cache groups sharing blocks of "
            f"{ready.block_size} tokens"
        )
    return (
        f"engine core ready in {start_s:.1f} s: KV cache of {ready.num_gpu_blocks} blocks = "
        f"{pool}, max_model_len {ready.max_model_len} (up to {num_full_length} requests at full "
        f"length at once), step budget {ready.max_num_batched_tokens} tokens, vocabulary "
        f"{ready.vocab_size}"
    )
