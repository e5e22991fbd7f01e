"""`EngineCoreProc`: the engine core process around `EngineCore`.

Three threads: the input thread owns the DEALER (decodes frames, builds `Request`s and their
block hashes, rejects malformed frames), the output thread owns the PUSH (encodes and sends),
and the main thread runs the busy loop (apply inputs, step, queue outputs). They only share the
two queues. Life cycle: start workers -> KV sizing handshake -> `EngineReady` on the DEALER ->
serve until a signal (exit 0, `EngineDead` sent) or a failure (every unfinished request gets an
ERROR output, then `EngineDead`; exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable

import msgspec
import zmq

from core.engine_core import EngineCore, make_error_output, make_outputs, make_request
from core.executor import Executor
from core.request import Request
from core.scheduler import Scheduler
from core.scheduler_config import SchedulerConfig
from proto import (
    AbortRequests,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    UtilityRequest,
    UtilityResponse,
)
from proto.codec import TYPE_TO_CODE
from proto.endpoints import frontend_endpoints
from proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
OUTPUT_LINGER_MS = 2000
UTILITY_METHODS = ("get_stats", "reset_prefix_cache", "ping")

InputItem = Request | AbortRequests | UtilityRequest


class ShutdownRequested(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT; unwinds to a clean shutdown."""


class EngineCoreProc:
    """Runs one engine core process; `run()` returns the process exit code."""

    def __init__(self, config: EngineConfig, frontend_address: str) -> None:
        self.config = config
        self.frontend_address = frontend_address
        self.context = zmq.Context()
        endpoints = frontend_endpoints(frontend_address)
        self.input_socket = self.context.socket(zmq.DEALER)
        self.input_socket.setsockopt(zmq.ROUTING_ID, f"core-{os.getpid()}".encode())
        self.input_socket.connect(endpoints.requests)
        self.output_socket = self.context.socket(zmq.PUSH)
        self.output_socket.connect(endpoints.outputs)
        self.input_queue: queue.Queue[InputItem] = queue.Queue()
        self.output_queue: queue.Queue[msgspec.Struct | None] = queue.Queue()
        self.stop_event = threading.Event()
        self.input_thread = _io_thread(self._input_loop, "core-input")
        self.output_thread = _io_thread(self._output_loop, "core-output")
        self.executor: Executor | None = None
        self.engine_core: EngineCore | None = None
        self.vocab_size = 0  # known once the workers report; requests are read only after that

    def run(self) -> int:
        _install_signal_handlers()
        self.output_thread.start()
        try:
            ready = self._start_engine()
            self.input_socket.send_multipart(MessageEncoder().encode(ready))
            logger.info("engine core ready: %s", ready)
            self.input_thread.start()
            self._run_busy_loop()
        except ShutdownRequested as exc:
            logger.info("engine core shutting down on %s", exc)
            self.output_queue.put(EngineDead(f"engine core was stopped by {exc}"))
            return 0
        except Exception as exc:
            logger.exception("engine core failed")
            self._fail_unfinished_requests(f"engine core failed: {exc}")
            return 1
        finally:
            self._shutdown()
        return 0

    # ---- start-up --------------------------------------------------------------------------

    def _start_engine(self) -> EngineReady:
        """Starts workers, sizes the KV cache (override, else the minimum over workers)."""
        self.executor = Executor(self.config, self.context, _ipc_parent_dir(self.frontend_address))
        worker_readies = self.executor.wait_until_ready()
        num_gpu_blocks = self.config.num_gpu_blocks_override or min(
            ready.num_gpu_blocks for ready in worker_readies
        )
        max_model_len = min(ready.max_model_len for ready in worker_readies)
        self.vocab_size = min(ready.vocab_size for ready in worker_readies)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=self.config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
            policy=self.config.policy,
        )
        self.executor.initialize_cache(num_gpu_blocks)
        self.engine_core = EngineCore(Scheduler(scheduler_config), self.executor)
        return EngineReady(num_gpu_blocks, self.config.block_size, max_model_len, self.vocab_size)

    # ---- main thread: busy loop ------------------------------------------------------------

    def _run_busy_loop(self) -> None:
        """Applies inputs, steps, queues outputs; forever (until an exception unwinds it)."""
        engine_core = self.engine_core
        while True:
            self._process_input_queue()
            outputs = engine_core.step()
            if outputs is not None and outputs.outputs:
                self.output_queue.put(outputs)

    def _process_input_queue(self) -> None:
        """Blocks while idle (re-checking the workers every POLL_INTERVAL_S), then drains."""
        while not self.engine_core.has_work:
            self.executor.check_alive()
            with contextlib.suppress(queue.Empty):
                self._handle_input(self.input_queue.get(timeout=POLL_INTERVAL_S))
        while True:
            try:
                self._handle_input(self.input_queue.get_nowait())
            except queue.Empty:
                return

    def _handle_input(self, item: InputItem) -> None:
        if isinstance(item, Request):
            error_output = self.engine_core.add_request(item)
            if error_output is not None:
                self.output_queue.put(make_outputs([error_output]))
        elif isinstance(item, AbortRequests):
            self.engine_core.abort_requests(item.request_ids)
        else:
            self.output_queue.put(self._call_utility(item))

    def _call_utility(self, call: UtilityRequest) -> UtilityResponse:
        if call.method == "get_stats":
            return UtilityResponse(call.call_id, stats=self.engine_core.get_stats())
        if call.method == "reset_prefix_cache":
            if self.engine_core.reset_prefix_cache():
                return UtilityResponse(call.call_id)
            return UtilityResponse(
                call.call_id, error="cannot reset the prefix cache while requests hold KV blocks"
            )
        if call.method == "ping":
            return UtilityResponse(call.call_id)
        return UtilityResponse(
            call.call_id,
            error=f"unknown utility method {call.method!r}; known: {', '.join(UTILITY_METHODS)}",
        )

    # ---- input thread ----------------------------------------------------------------------

    def _input_loop(self) -> None:
        # The size limit is the decoder's, not zmq.MAXMSGSIZE: on a connecting socket an
        # oversized message would cut the link to the frontend for good (no reconnect).
        decoder = MessageDecoder(
            [EngineCoreRequest, AbortRequests, UtilityRequest], self.config.max_frame_bytes
        )
        while not self.stop_event.is_set():
            if not self.input_socket.poll(POLL_INTERVAL_S * 1000):
                continue
            frames = [frame.buffer for frame in self.input_socket.recv_multipart(copy=False)]
            item = self._decode_input(decoder, frames)
            if item is not None:
                self.input_queue.put(item)

    def _decode_input(self, decoder: MessageDecoder, frames: list[memoryview]) -> InputItem | None:
        """The item for the busy loop, or None after answering/logging a bad frame."""
        try:
            message = decoder.decode(frames)
        except MessageDecodeError as exc:
            logger.warning("rejected a malformed frame from the frontend: %s", exc)
            request_id = _peek_request_id(frames, self.config.max_frame_bytes)
            if request_id is not None:
                self._send_error(request_id, f"malformed request: {exc}")
            return None
        if not isinstance(message, EngineCoreRequest):
            return message
        try:
            return make_request(message, self.config.block_size, self.vocab_size)
        except Exception as exc:
            logger.warning("rejected request %r: %s", message.request_id, exc)
            self._send_error(message.request_id, f"invalid request: {exc}")
            return None

    def _send_error(self, request_id: str, message: str) -> None:
        self.output_queue.put(make_outputs([make_error_output(request_id, message)]))

    # ---- output thread ---------------------------------------------------------------------

    def _output_loop(self) -> None:
        """Sends queued messages in order until the None sentinel."""
        encoder = MessageEncoder()
        while (message := self.output_queue.get()) is not None:
            self.output_socket.send_multipart(encoder.encode(message), copy=False)

    # ---- failure and shutdown --------------------------------------------------------------

    def _fail_unfinished_requests(self, reason: str) -> None:
        """One ERROR output per request the core holds or has queued, then EngineDead."""
        _ignore_signals()
        self.stop_event.set()
        if self.input_thread.is_alive():
            self.input_thread.join()
        request_ids = self.engine_core.unfinished_request_ids() if self.engine_core else []
        while not self.input_queue.empty():
            item = self.input_queue.get_nowait()
            if isinstance(item, Request):
                request_ids.append(item.request_id)
        if request_ids:
            self.output_queue.put(make_outputs([make_error_output(r, reason) for r in request_ids]))
        self.output_queue.put(EngineDead(reason))

    def _shutdown(self) -> None:
        """Flushes outputs, stops workers, closes sockets. Ignores further signals meanwhile."""
        _ignore_signals()
        self.stop_event.set()
        if self.input_thread.is_alive():
            self.input_thread.join()
        self.output_queue.put(None)
        self.output_thread.join(timeout=self.config.shutdown_timeout_s)
        if self.executor is not None:
            self.executor.shutdown()
        self.input_socket.close(linger=0)
        if self.output_thread.is_alive():
            # Blocked on a frontend that stopped reading; its socket dies with the process.
            logger.warning("outputs not flushed within %s s", self.config.shutdown_timeout_s)
            return
        self.output_socket.close(linger=OUTPUT_LINGER_MS)
        self.context.term()


def _io_thread(loop: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `loop`; if `loop` crashes, the process shuts down (SIGTERM)
    rather than serve on with a dead input or output path."""

    def run() -> None:
        try:
            loop()
        except Exception:
            logger.exception("engine core thread %s crashed; shutting down", name)
            os.kill(os.getpid(), signal.SIGTERM)

    return threading.Thread(target=run, name=name, daemon=True)


def _install_signal_handlers() -> None:
    def handle(signum: int, frame: object) -> None:
        _ignore_signals()
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


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


def _ipc_parent_dir(frontend_address: str) -> str | None:
    """Worker sockets go next to the frontend's ipc sockets (its private dir), else to /tmp."""
    if frontend_address.startswith("ipc://"):
        return os.path.dirname(frontend_address.removeprefix("ipc://"))
    return None
