"""`MultiprocExecutor`: the engine core's side of the worker processes (a `PollableExecutor`).

It starts ranks 0..K-1 (`EngineConfig.num_local_ranks`, by default all `tensor_parallel_size`)
as processes (`python -m core_engine.worker`, so `core/` never imports `worker/`) and talks to each over its
own `MessagePipe`, a socketpair whose other end the worker inherits. Ranks K..N-1 run on other
hosts: they connect to the core's `worker_address` and join through `WorkerListener`'s
handshake, and their pipe is that TCP connection. Either way, messages are broadcast to every
rank, and answers collected (every rank answers start-up messages; only rank 0 answers a step).

A local worker that exits closes its end, so its death is seen at once; a remote worker has no
process here, and its connection is its liveness: its process's exit (kill -9 included) closes
the connection at once, and a host that vanishes is reported by TCP keepalive within
`DEAD_PEER_TIMEOUT_S` (see `proto.message_pipe`). Every wait is also bounded and re-checks every
worker's liveness at least every `POLL_INTERVAL_S`.

The executor only sends and receives. Its blocking calls (`wait_until_ready`, `initialize_cache`,
`execute_model`) wait on the workers alone; an owner that must serve other sockets while a step
runs polls `pipe_fds()` itself next to them, after `send_step`, and hands each readable pipe to
`receive_step_output`.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from dataclasses import dataclass

import msgspec
import zmq

from core_engine.common.config_error import ConfigError
from core_engine.common.ports import find_free_port
from core_engine.common.process_watch import describe_exit, python_module_command, stop_process
from core_engine.core.executor.executor import WorkerFailedError
from core_engine.core.executor.worker_listener import WorkerListener
from core_engine.proto import (
    InitKVCache,
    KVCacheReady,
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
)
from core_engine.proto.endpoints import parse_tcp_address
from core_engine.proto.engine_config import EngineConfig, describe_ranks
from core_engine.proto.message_pipe import (
    MessagePipe,
    PeerClosedError,
    PeerUnreachableError,
    pipe_pair,
)

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# When one rank of a tensor-parallel group dies, the others fail in their next collective within
# milliseconds and report that; this long a reported error waits for the rank that really died.
PEER_DEATH_GRACE_S = 0.5
# How long a worker whose pipe closed may take to exit before it is reported as still running.
EXIT_AFTER_CLOSE_S = 5.0


@dataclass(slots=True)
class WorkerProcess:
    """One rank: a local child `process` with a socketpair `pipe`, or (`process` None) a worker
    on another host whose `pipe` is its TCP connection from `peer_address`."""

    rank: int
    pipe: MessagePipe
    process: subprocess.Popen | None = None
    peer_address: str | None = None

    @property
    def is_remote(self) -> bool:
        return self.process is None

    def has_exited(self) -> bool:
        """A local process that exited; a remote worker whose connection closed or failed."""
        if self.process is None:
            return self.pipe.peer_closed()
        return self.process.poll() is not None

    def was_killed(self) -> bool:
        """Ended without a word: a local process by a signal; a remote worker's connection
        gone with no message left unread (a worker that fails reports a WorkerError first)."""
        if self.process is None:
            return self.pipe.peer_closed() and not self.pipe.has_unread_bytes()
        return self.process.poll() is not None and self.process.returncode < 0

    @property
    def name(self) -> str:
        where = f"at {self.peer_address}" if self.process is None else f"pid {self.process.pid}"
        return f"worker rank {self.rank} ({where})"


class MultiprocExecutor:
    """Owns the worker processes and their pipes; not thread-safe (the busy loop's thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: list[WorkerProcess] = []
        self._encoder = MessageEncoder()
        self._decoder = MessageDecoder([WorkerReady, KVCacheReady, ModelRunnerOutput, WorkerError])
        self._poller = zmq.Poller()
        self._fd_to_worker: dict[int, WorkerProcess] = {}
        self._listener: WorkerListener | None = None
        # Every wait on a pipe is bounded by the longest deadline; callers keep their own.
        self._pipe_timeout_s = max(config.startup_timeout_s, config.step_timeout_s)
        try:
            dist_init_address = config.dist_init_address or _default_dist_init_address(config)
            if config.remote_ranks:
                # Listening first: an address in use fails before any process starts.
                self._listener = WorkerListener(config, dist_init_address, self._pipe_timeout_s)
                logger.info(
                    "waiting for %s to join at %s (torch.distributed rendezvous at %s)",
                    describe_ranks(config.remote_ranks),
                    config.worker_address,
                    dist_init_address,
                )
            for rank in range(config.num_local_ranks):
                self._add_worker(self._start_worker(rank, dist_init_address))
        except BaseException:
            self.shutdown()
            raise

    def _add_worker(self, worker: WorkerProcess) -> None:
        self._poller.register(worker.pipe.fileno(), zmq.POLLIN)
        self._fd_to_worker[worker.pipe.fileno()] = worker
        self.workers.append(worker)
        self.workers.sort(key=lambda w: w.rank)

    def _start_worker(self, rank: int, dist_init_address: str) -> WorkerProcess:
        pipe, child_end = pipe_pair(self._pipe_timeout_s)
        argv = [
            *python_module_command("core_engine.worker"),
            "--rank", str(rank),
            "--world-size", str(self.config.tensor_parallel_size),
            "--pipe-fd", str(child_end.fileno()),
            "--dist-init-address", dist_init_address,
            "--config", self.config.to_b64(),
        ]  # fmt: skip
        try:
            process = subprocess.Popen(argv, pass_fds=[child_end.fileno()])
        except BaseException:
            pipe.close()
            raise
        finally:
            child_end.close()  # the worker's copy is the only one: its exit closes the pipe
        logger.info("started worker rank %d (pid %d)", rank, process.pid)
        return WorkerProcess(rank, pipe, process)

    # ---- start-up handshake ----------------------------------------------------------------

    def wait_until_ready(self) -> list[WorkerReady]:
        """Every rank's WorkerReady (joined if remote, model loaded, memory profiled), in rank
        order; all within startup_timeout_s."""
        timeout_s = self.config.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        if self._listener is not None:
            self._join_remote_workers(deadline)
        rank_to_ready = self._collect(WorkerReady, timeout_s, "start-up", deadline=deadline)
        return [rank_to_ready[rank] for rank in range(len(self.workers))]

    def _join_remote_workers(self, deadline: float) -> None:
        """Takes every remote rank's connection by `deadline`, watching the local workers
        meanwhile; later arrivals are then told why they cannot join (until shutdown)."""
        listener = self._listener
        while missing := listener.missing_ranks:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise WorkerFailedError(
                    f"worker {describe_ranks(missing)} never joined at {listener.address} "
                    f"within startup_timeout_s={self.config.startup_timeout_s} s (start each "
                    f"on its host: python -m core_engine.worker --core-address {listener.address} --rank R "
                    f"--world-size {self.config.tensor_parallel_size})"
                )
            for joined in listener.accept(min(remaining_s, POLL_INTERVAL_S)):
                self._add_worker(
                    WorkerProcess(joined.rank, joined.pipe, peer_address=joined.peer_address)
                )
            self.check_alive()
        listener.keep_rejecting()

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        """Tells every rank to allocate `num_gpu_blocks` and waits for all KVCacheReady."""
        self._broadcast(InitKVCache(num_gpu_blocks))
        self._collect(KVCacheReady, self.config.startup_timeout_s, "KV cache allocation")

    # ---- steps -----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcasts one step and returns rank 0's sampled tokens."""
        self.send_step(scheduler_output)
        return self._collect(ModelRunnerOutput, self.config.step_timeout_s, "a step", 1)[0]

    def send_step(self, scheduler_output: SchedulerOutput) -> None:
        """Broadcasts one step; its answer comes through `receive_step_output`."""
        self._broadcast(scheduler_output)

    def pipe_fds(self) -> list[int]:
        """The descriptors to poll for the workers' messages: a pipe is readable when a worker
        answered, reported an error, or exited."""
        return list(self._fd_to_worker)

    def receive_step_output(self, fd: int) -> ModelRunnerOutput:
        """The step's answer from the worker whose pipe `fd` polled readable. Anything else (its
        error report, its exit, another message) raises WorkerFailedError."""
        worker = self._fd_to_worker[fd]
        message = self._receive(worker)
        if not isinstance(message, ModelRunnerOutput):
            raise self._unexpected_message(worker, "during a step", message, ModelRunnerOutput)
        return message

    def fail_on_message(self, fd: int) -> WorkerFailedError | ConfigError:
        """The error for a worker whose pipe `fd` polled readable between steps (a worker
        speaks only when asked, so it reported an error or exited)."""
        return self._unexpected_message(self._fd_to_worker[fd], "between steps")

    def check_alive(self) -> None:
        """Raises WorkerFailedError if any worker exited (or a remote one disconnected); prefers
        the worker's own error text."""
        dead = [w for w in self.workers if w.has_exited()]
        if not dead:
            return
        for worker in dead:
            error = self._last_words(worker)
            if error is not None:
                raise self._worker_failed(error)
        raise WorkerFailedError(self._describe_death(dead[0]))

    def _last_words(self, worker: WorkerProcess) -> WorkerError | None:
        """The WorkerError an exited worker left unread in its pipe, if any."""
        while _is_readable(worker.pipe):
            try:
                message = self._receive(worker)
            except WorkerFailedError:
                return None
            if isinstance(message, WorkerError):
                return message
        return None

    def _worker_failed(self, error: WorkerError) -> WorkerFailedError | ConfigError:
        """`error`, preceded by every other rank that a signal ended (kill -9, the OOM killer, a
        crash), or that disconnected without a word if remote: such a rank is the cause, and
        the surviving ranks' failed collectives ("Connection reset by peer") are symptoms. A
        worker's config error is a ConfigError with the worker's message, as it is."""
        if error.is_config_error:
            return ConfigError(error.message)
        wait_s = PEER_DEATH_GRACE_S if len(self.workers) > 1 else 0.0
        causes = [self._describe_death(w) for w in self._killed_workers(error.rank, wait_s)]
        return WorkerFailedError("; ".join([*causes, _describe_worker_error(error)]))

    def _pipe_closed(
        self, worker: WorkerProcess, error: PeerClosedError | None = None
    ) -> WorkerFailedError:
        """The error for a worker whose pipe closed: its exit, once it has exited; for a remote
        worker, its connection's end (`error` says how, when known)."""
        if worker.is_remote:
            return WorkerFailedError(self._describe_death(worker, error))
        try:
            worker.process.wait(EXIT_AFTER_CLOSE_S)
        except subprocess.TimeoutExpired:
            return WorkerFailedError(
                f"worker rank {worker.rank} (pid {worker.process.pid}) closed its pipe"
            )
        return WorkerFailedError(self._describe_death(worker))

    def _describe_death(self, worker: WorkerProcess, error: PeerClosedError | None = None) -> str:
        """How `worker` ended, for the error that fails the engine; an executor that knows more
        about its workers' hosts (`RayExecutor`) adds what it knows."""
        return _describe_death(worker, error)

    def _killed_workers(self, other_than_rank: int, wait_s: float) -> list[WorkerProcess]:
        """Workers other than `other_than_rank` that ended without a word (`was_killed`),
        waiting up to `wait_s` for the first one."""
        deadline = time.monotonic() + wait_s
        while True:
            killed = [w for w in self.workers if w.rank != other_than_rank and w.was_killed()]
            if killed or time.monotonic() >= deadline:
                return killed
            time.sleep(POLL_INTERVAL_S / 10)

    def _broadcast(self, message: msgspec.Struct) -> None:
        """Sends `message` to every rank. A send waits only while a rank's socket buffer is
        full, and at most the pipe's timeout."""
        frames = self._encoder.encode(message)
        for worker in self.workers:
            try:
                worker.pipe.send(frames)
            except PeerClosedError as exc:
                raise self._pipe_closed(worker, exc) from None
            except TimeoutError:
                raise WorkerFailedError(
                    f"worker rank {worker.rank} took no message for {worker.pipe.timeout_s} s"
                ) from None

    def _collect(
        self,
        expected: type,
        timeout_s: float,
        what: str,
        num_answers: int | None = None,
        deadline: float | None = None,
    ) -> dict[int, msgspec.Struct]:
        """Rank -> answer of type `expected` from `num_answers` ranks (default: all), within
        `timeout_s` from now or by `deadline` when given."""
        num_answers = len(self.workers) if num_answers is None else num_answers
        rank_to_answer: dict[int, msgspec.Struct] = {}
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        while len(rank_to_answer) < num_answers:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise WorkerFailedError(
                    f"{len(rank_to_answer)} of {num_answers} workers answered {what} within "
                    f"{timeout_s} s"
                )
            ready = self._poll(min(remaining_s, POLL_INTERVAL_S))
            if not ready:
                self.check_alive()
            for fd, _ in ready:
                worker = self._fd_to_worker[fd]
                message = self._receive(worker)
                if not isinstance(message, expected):
                    raise self._unexpected_message(worker, f"during {what}", message, expected)
                rank_to_answer[worker.rank] = message
        return rank_to_answer

    def _poll(self, timeout_s: float) -> list[tuple[int, int]]:
        """(pipe fd, event) pairs ready now, waiting up to `timeout_s`."""
        return self._poller.poll(timeout_s * 1000)

    def _unexpected_message(
        self,
        worker: WorkerProcess,
        when: str,
        message: msgspec.Struct | None = None,
        expected: type | None = None,
    ) -> WorkerFailedError | ConfigError:
        """The error for a message from `worker` that was not awaited (read now if `message`
        is None): the worker's own error or death if that is what it was."""
        message = self._receive(worker) if message is None else message
        if isinstance(message, WorkerError):
            return self._worker_failed(message)
        wanted = f"expected {expected.__name__}, " if expected is not None else ""
        return WorkerFailedError(
            f"worker rank {worker.rank} sent {type(message).__name__} {when} ({wanted}"
            "the worker and the core disagree on the protocol)"
        )

    def _receive(self, worker: WorkerProcess) -> msgspec.Struct:
        """The next message from `worker` (call when its pipe is readable)."""
        try:
            frames = worker.pipe.recv()
        except PeerClosedError as exc:
            raise self._pipe_closed(worker, exc) from None
        except TimeoutError:
            raise WorkerFailedError(
                f"worker rank {worker.rank} sent part of a message and then nothing for "
                f"{worker.pipe.timeout_s} s"
            ) from None
        try:
            return self._decoder.decode(frames)
        except MessageDecodeError as exc:
            raise WorkerFailedError(
                f"malformed message from worker rank {worker.rank}: {exc}"
            ) from exc

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Asks every worker to exit, then stops stragglers and closes the pipes.

        A remote worker cannot be stopped from here: it gets the same Shutdown and the same
        time to close its connection before the core closes its end (which also ends a remote
        worker that is still running, see `python -m core_engine.worker --core-address`).
        Bounded by about `2 * shutdown_timeout_s`; safe to call more than once.
        """
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        frames = self._encoder.encode(Shutdown())
        for worker in self.workers:
            # A worker already gone or not reading is stopped by stop_process below.
            worker.pipe.timeout_s = 0.0
            with contextlib.suppress(OSError):
                worker.pipe.send(frames)
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        for worker in self.workers:
            if worker.is_remote:
                _wait_for_disconnect(worker.pipe, deadline)
            else:
                try:
                    worker.process.wait(max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    logger.warning("worker rank %d did not exit in time; terminating", worker.rank)
                stop_process(worker.process, self.config.shutdown_timeout_s)
            worker.pipe.close()
        self.workers.clear()


def _default_dist_init_address(config: EngineConfig) -> str:
    """127.0.0.1 when every rank is local, else the host the core listens on for workers (a
    free port there); EngineConfig has checked that this host is one the others can reach."""
    host = "127.0.0.1"
    if config.remote_ranks:
        host, _ = parse_tcp_address(config.worker_address)
    address_host = f"[{host}]" if ":" in host else host
    return f"tcp://{address_host}:{find_free_port(host)}"


def _wait_for_disconnect(pipe: MessagePipe, deadline: float) -> None:
    """Waits until the peer closed `pipe` or `deadline` passes, discarding what it still sends."""
    while not pipe.peer_closed() and (remaining_s := deadline - time.monotonic()) > 0:
        if zmq.select([pipe], [], [], remaining_s)[0] and not pipe.peer_closed():
            pipe.timeout_s = max(deadline - time.monotonic(), 0.0)
            try:
                pipe.recv()
            except OSError:
                return


def _is_readable(pipe: MessagePipe) -> bool:
    return bool(zmq.select([pipe], [], [], 0)[0])


def _describe_worker_error(error: WorkerError) -> str:
    return f"worker rank {error.rank} failed: {error.message}"


def _describe_death(worker: WorkerProcess, error: PeerClosedError | None = None) -> str:
    if isinstance(error, PeerUnreachableError):
        return f"{worker.name} stopped answering: {error}"
    if worker.is_remote and error is not None:
        return f"{worker.name} closed its connection (its process exited or was killed)"
    if worker.is_remote:
        return f"{worker.name} disconnected: its process ended, or its host or the network failed"
    return f"{worker.name} died ({describe_exit(worker.process.returncode)})"
