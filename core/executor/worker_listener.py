"""`WorkerListener`: where workers on other hosts join the engine core over TCP.

The core listens on `EngineConfig.worker_address` for the ranks it does not start itself
(`EngineConfig.remote_ranks`). A worker (`python -m core_engine.worker --core-address ...`) connects and
sends `WorkerHello`; the listener checks it (protocol version, world size, a remote rank not
taken yet) and answers `WorkerWelcome`, after which the connection is that rank's `MessagePipe`
(the same framing as a local worker's socketpair). Anything else is answered with
`WorkerRejected` and the reason, logged, and closed, leaving every other connection alone; a
connection that sends no hello within HELLO_TIMEOUT_S is closed. Nothing here waits longer than
`accept(timeout_s)` says: the executor keeps the deadline and watches its local workers meanwhile.
Once every rank has joined, `keep_rejecting()` hands the listener to a daemon thread that tells
later arrivals (a rank started twice, a restarted worker) why they cannot join, until `close()`.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass

from core_engine.proto import (
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    WorkerHello,
    WorkerRejected,
    WorkerWelcome,
)
from core_engine.proto.endpoints import parse_tcp_address
from core_engine.proto.engine_config import EngineConfig, describe_ranks
from core_engine.proto.message_pipe import MessagePipe, PayloadTooLargeError, configure_tcp_link
from core_engine.proto.worker_messages import WORKER_PROTOCOL_VERSION

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
# A hello is a few bytes; a connection announcing more is not a worker of ours.
MAX_HELLO_BYTES = 4096
# How long sending the answer to a hello may take (it fits any socket buffer).
ANSWER_TIMEOUT_S = 5.0
LISTEN_BACKLOG = 64
REJECTING_POLL_INTERVAL_S = 0.2


@dataclass(slots=True)
class JoinedWorker:
    """A rank whose hello was accepted; `pipe` carries the rest of its link."""

    rank: int
    pipe: MessagePipe
    peer_address: str


@dataclass(slots=True)
class _Connection:
    """An accepted connection whose hello has not arrived yet."""

    sock: socket.socket
    pipe: MessagePipe
    peer_address: str
    deadline: float


class WorkerListener:
    """Listens from construction (OSError naming the address if it cannot) until `close()`.
    Not thread-safe: one thread uses it, and after `keep_rejecting()` only `close()` may be
    called."""

    def __init__(self, config: EngineConfig, dist_init_address: str, pipe_timeout_s: float) -> None:
        self.address = config.worker_address
        host, port = parse_tcp_address(config.worker_address, "worker_address")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot listen for workers at {self.address}: {exc.strerror or exc}"
            ) from exc
        self._socket.setblocking(False)
        self._config = config
        self._pipe_timeout_s = pipe_timeout_s
        self._rank_to_peer: dict[int, str] = {}
        self._fd_to_connection: dict[int, _Connection] = {}
        self._encoder = MessageEncoder()
        self._welcome = WorkerWelcome(config, dist_init_address)
        self._decoder = MessageDecoder([WorkerHello], MAX_HELLO_BYTES)
        self._rejecting: threading.Thread | None = None
        self._stop_rejecting = threading.Event()

    @property
    def missing_ranks(self) -> list[int]:
        """Remote ranks that have not joined yet."""
        return [r for r in self._config.remote_ranks if r not in self._rank_to_peer]

    def accept(self, timeout_s: float) -> list[JoinedWorker]:
        """Waits up to `timeout_s` for connections and hellos; the ranks that joined meanwhile."""
        poller = select.poll()  # not select.select: no limit on descriptor numbers
        for fd in (self._socket.fileno(), *self._fd_to_connection):
            poller.register(fd, select.POLLIN)
        joined = []
        for fd, _ in poller.poll(max(timeout_s, 0.0) * 1000):
            if fd == self._socket.fileno():
                self._accept_connections()
            elif (worker := self._read_hello(fd)) is not None:
                joined.append(worker)
        self._drop_silent_connections()
        return joined

    def keep_rejecting(self) -> None:
        """Answers every later connection from a daemon thread (each gets WorkerRejected: its
        rank is taken or not remote) until `close()`."""
        self._rejecting = threading.Thread(
            target=self._reject_until_closed, name="worker-listener", daemon=True
        )
        self._rejecting.start()

    def _reject_until_closed(self) -> None:
        while not self._stop_rejecting.is_set():
            try:
                self.accept(REJECTING_POLL_INTERVAL_S)
            except Exception:  # never let a bad peer end the thread with a traceback
                logger.exception("the worker listener at %s failed", self.address)
                return

    def close(self) -> None:
        """Stops listening and closes connections that never said hello; joined pipes stay."""
        if self._rejecting is not None:
            self._stop_rejecting.set()
            self._rejecting.join(2 * REJECTING_POLL_INTERVAL_S + ANSWER_TIMEOUT_S)
        self._socket.close()
        for connection in self._fd_to_connection.values():
            connection.pipe.close()
        self._fd_to_connection.clear()

    def _accept_connections(self) -> None:
        while True:
            try:
                sock, peer = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # the peer gave up before we got to it (ECONNABORTED, ...)
                logger.warning("accepting a worker connection at %s failed: %s", self.address, exc)
                return
            configure_tcp_link(sock)
            pipe = MessagePipe(sock, timeout_s=0.0)  # never wait on a peer not yet known
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            connection = _Connection(sock, pipe, _format_peer(peer), deadline)
            self._fd_to_connection[pipe.fileno()] = connection

    def _read_hello(self, fd: int) -> JoinedWorker | None:
        connection = self._fd_to_connection[fd]
        try:
            hello = self._decoder.decode(connection.pipe.recv(MAX_HELLO_BYTES))
        except (BlockingIOError, TimeoutError):
            return None  # part of the hello; the rest comes later (nothing was consumed)
        except (MessageDecodeError, PayloadTooLargeError) as exc:
            self._reject(fd, f"expected a WorkerHello as the first message: {exc}")
            return None
        except OSError as exc:  # closed or reset before saying hello
            logger.warning(
                "a connection from %s to %s closed before its hello: %s",
                connection.peer_address,
                self.address,
                exc,
            )
            self._close_connection(fd)
            return None
        reason = self._check_hello(hello)
        if reason is not None:
            self._reject(fd, reason, hello.rank)
            return None
        connection.pipe.timeout_s = ANSWER_TIMEOUT_S
        try:
            connection.pipe.send(self._encoder.encode(self._welcome))
        except OSError as exc:
            logger.warning(
                "worker rank %d from %s left before its welcome: %s",
                hello.rank,
                connection.peer_address,
                exc,
            )
            self._close_connection(fd)
            return None
        del self._fd_to_connection[fd]
        connection.pipe.timeout_s = self._pipe_timeout_s
        self._rank_to_peer[hello.rank] = connection.peer_address
        logger.info("worker rank %d joined from %s", hello.rank, connection.peer_address)
        return JoinedWorker(hello.rank, connection.pipe, connection.peer_address)

    def _check_hello(self, hello: WorkerHello) -> str | None:
        """Why `hello` is refused, or None to take it."""
        config = self._config
        world_size = config.tensor_parallel_size
        remote = describe_ranks(config.remote_ranks)
        if hello.protocol_version != WORKER_PROTOCOL_VERSION:
            return (
                f"protocol version {hello.protocol_version}, but this engine core speaks "
                f"{WORKER_PROTOCOL_VERSION}: run the same engine version on every host"
            )
        if hello.world_size != world_size:
            return (
                f"world size {hello.world_size}, but the engine's tensor_parallel_size is "
                f"{world_size} (start the worker with --world-size {world_size})"
            )
        if not 0 <= hello.rank < world_size:
            return (
                f"rank {hello.rank} is outside [0, {world_size}); only {remote} may join over TCP"
            )
        if hello.rank not in config.remote_ranks:
            return (
                f"rank {hello.rank} is one of the engine core's local workers "
                f"({describe_ranks(range(config.num_local_ranks))}); only {remote} may join "
                "over TCP"
            )
        if hello.rank in self._rank_to_peer:
            return f"rank {hello.rank} has already joined (from {self._rank_to_peer[hello.rank]})"
        return None

    def _reject(self, fd: int, reason: str, rank: int | None = None) -> None:
        connection = self._fd_to_connection[fd]
        who = "a worker" if rank is None else f"a worker claiming rank {rank}"
        logger.warning(
            "rejected %s from %s at %s: %s", who, connection.peer_address, self.address, reason
        )
        # A fresh pipe on the socket: the connection's own may refuse use after a bad header.
        with contextlib.suppress(OSError):
            answer = MessagePipe(connection.sock, ANSWER_TIMEOUT_S)
            answer.send(self._encoder.encode(WorkerRejected(reason)))
        # Closing with unread bytes would send a reset, which may overtake the reason.
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_WR)
            _discard_unread(connection.sock)
        self._close_connection(fd)

    def _drop_silent_connections(self) -> None:
        now = time.monotonic()
        for fd, connection in list(self._fd_to_connection.items()):
            if now > connection.deadline:
                logger.warning(
                    "closed a connection from %s to %s that sent no WorkerHello in %s s",
                    connection.peer_address,
                    self.address,
                    HELLO_TIMEOUT_S,
                )
                self._close_connection(fd)

    def _close_connection(self, fd: int) -> None:
        self._fd_to_connection.pop(fd).pipe.close()


def _discard_unread(sock: socket.socket, max_bytes: int = 1 << 20) -> None:
    """Reads and drops what `sock` has received so far (up to `max_bytes`), without waiting."""
    sock.setblocking(False)
    num_read = 0
    with contextlib.suppress(OSError):  # nothing more for now (EAGAIN), or the peer is gone
        while num_read < max_bytes and (data := sock.recv(65536)):
            num_read += len(data)


def _format_peer(peer: tuple) -> str:
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
