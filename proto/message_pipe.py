"""`MessagePipe`: wire messages over one end of a stream socket: a socketpair to a local
worker, a TCP connection to a worker on another host.

The engine core talks to a fixed set of workers it knows by rank, so their link needs none of
ZeroMQ's routing, reconnection or I/O threads. A ZeroMQ hop passes each message through
an I/O thread on both sides, two extra thread wake-ups; a socketpair wakes the reader directly,
so no message pays for them (`benchmarks/micro/ipc.py` measures the core round trip this hop is
part of). It also reports a dead peer at once: a read sees end of file and a write fails, where
ZeroMQ would wait forever.

Wire format, per message: an 8-byte header (payload length, u32 little-endian; type code, one
byte; three zero bytes), then the payload. A message is the two frames `MessageEncoder` makes,
so the same `MessageDecoder` reads what `recv` returns. A read never takes bytes past the message
being read (the header, then exactly its payload), so whether `fileno()` polls readable is the
whole truth about what is waiting: a poller needs no second look at the pipe.

Over TCP (`configure_tcp_link`) a killed peer process still closes its end at once (its kernel
sends FIN or RST); a peer host that vanishes, or a cut network, answers nothing, so TCP keepalive
probes and a user timeout on unacknowledged data report it within `DEAD_PEER_TIMEOUT_S`
(PeerUnreachableError, a PeerClosedError).

Not thread-safe: one thread sends and receives on a pipe.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
from collections.abc import Sequence

HEADER = struct.Struct("<IB3x")
MAX_PAYLOAD_BYTES = 2**32 - 1
READ_BUFFER_BYTES = 64 * 1024
CODE_FRAMES = tuple(bytes((code,)) for code in range(256))
# An idle TCP link is probed after KEEPALIVE_IDLE_S, then every KEEPALIVE_INTERVAL_S; after
# KEEPALIVE_PROBES unanswered probes, or as long unacknowledged data, the link is dead.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
DEAD_PEER_TIMEOUT_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
LINK_FAILURE_ERRNOS = frozenset(
    (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)
)
# poll() flags that say the peer's side is gone (Linux's POLLRDHUP: it shut down or closed).
PEER_GONE_EVENTS = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class PeerClosedError(ConnectionError):
    """The other end is closed: its process exited or closed the pipe."""


class PeerUnreachableError(PeerClosedError):
    """A TCP link's other end answered nothing (keepalive probes, retransmissions) for about
    DEAD_PEER_TIMEOUT_S: its host went away or the network between is cut."""


class PipeBrokenError(ConnectionError):
    """A timeout cut a message short, so the stream is out of step: the pipe refuses all use."""


class PayloadTooLargeError(ValueError):
    """A header announced more than the caller's `max_payload_bytes`; nothing of the payload
    was read, so the pipe refuses further use."""


def _peer_gone_error(exc: OSError) -> PeerUnreachableError | None:
    """The error for a TCP link that failed (keepalive or user timeout: ETIMEDOUT, or the soft
    error the last attempts met, such as EHOSTUNREACH), None for any other error (a plain
    socket timeout has no errno)."""
    if exc.errno not in LINK_FAILURE_ERRNOS:
        return None
    return PeerUnreachableError(
        f"no answer from the other end's host for about {DEAD_PEER_TIMEOUT_S} s of TCP "
        f"keepalive probes or retransmissions ({exc.strerror}): it went away, or the network "
        "between is cut"
    )


class MessagePipe:
    """Sends and receives `[type code, payload]` messages over a connected stream socket.

    `timeout_s` bounds each wait for the peer (None: wait without limit); running out raises
    `TimeoutError`. A closed peer raises `PeerClosedError`, also in the middle of a
    message. A `recv` that times out may be retried when the message fits the read buffer
    (nothing of it is consumed until all of it is there); a timeout in the middle of a larger
    message, or of a `send`, leaves the stream out of step, and every later call raises
    `PipeBrokenError`.
    """

    def __init__(self, sock: socket.socket, timeout_s: float | None = None) -> None:
        self._socket = sock
        self._socket.settimeout(timeout_s)
        # Bytes read but not yet returned are self._buffer[self._start:self._end].
        self._buffer = bytearray(READ_BUFFER_BYTES)
        self._buffer_view = memoryview(self._buffer)
        self._start = self._end = 0
        self._broken: str | None = None  # why the pipe refuses use, once it does

    @classmethod
    def from_fd(cls, fd: int, timeout_s: float | None = None) -> MessagePipe:
        """The pipe end a parent passed to this process as file descriptor `fd`."""
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)  # processes this one starts must not keep the link open
        return cls(sock, timeout_s)

    @property
    def timeout_s(self) -> float | None:
        return self._socket.gettimeout()

    @timeout_s.setter
    def timeout_s(self, timeout_s: float | None) -> None:
        """0 makes every call fail with BlockingIOError instead of waiting."""
        self._socket.settimeout(timeout_s)

    def fileno(self) -> int:
        """The socket's descriptor, so that `select`/`zmq.Poller` can wait on the pipe."""
        return self._socket.fileno()

    def send(self, frames: Sequence[bytes]) -> None:
        """Sends one message: `frames` is `[type code (1 byte), payload]`."""
        code, payload = frames
        if len(code) != 1:
            raise ValueError(f"a type code is 1 byte, got {len(code)}")
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"payload of {len(payload)} bytes exceeds the pipe's limit of {MAX_PAYLOAD_BYTES}"
            )
        self._require_intact()
        header = HEADER.pack(len(payload), code[0])
        num_sent = 0
        try:
            num_sent = self._socket.sendmsg([header, payload])
            if num_sent < len(header):  # the socket buffer filled up
                self._socket.sendall(header[num_sent:])
                num_sent = len(header)
            if num_sent < len(header) + len(payload):
                self._socket.sendall(memoryview(payload)[num_sent - len(header) :])
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PeerClosedError("the other end of the pipe is closed") from exc
        except OSError as exc:
            if (peer_gone := _peer_gone_error(exc)) is not None:
                raise peer_gone from exc
            if not isinstance(exc, (TimeoutError, BlockingIOError)):
                raise
            if num_sent > 0:
                total = len(header) + len(payload)
                self._broken = f"a send timed out after at least {num_sent} of {total} bytes"
            raise

    def recv(self, max_payload_bytes: int | None = None) -> list[bytes | bytearray]:
        """The next message as `[type code, payload]`, waiting for it as `timeout_s` allows.

        Two reads: the header, then the payload it announces; a payload over `max_payload_bytes`
        (for a peer not yet trusted) raises PayloadTooLargeError before it is read."""
        self._require_intact()
        self._fill(HEADER.size)
        payload_bytes, code = HEADER.unpack_from(self._buffer, self._start)
        if max_payload_bytes is not None and payload_bytes > max_payload_bytes:
            self._broken = f"a header announced {payload_bytes} bytes"
            raise PayloadTooLargeError(
                f"a message announced {payload_bytes} bytes, over the limit of {max_payload_bytes}"
            )
        message_bytes = HEADER.size + payload_bytes
        if message_bytes <= len(self._buffer):
            self._fill(message_bytes, HEADER.size)
            self._start += message_bytes
            return [CODE_FRAMES[code], self._buffer[self._start - payload_bytes : self._start]]
        self._start += HEADER.size
        try:
            return [CODE_FRAMES[code], self._read_large(payload_bytes)]
        except (TimeoutError, BlockingIOError):
            self._broken = f"a recv timed out inside a {payload_bytes}-byte message"
            raise

    def peer_closed(self) -> bool:
        """True once the other end closed its side or the link failed (reset, keepalive
        timeout), without waiting or reading: messages it sent before may still be unread."""
        return bool(self._events_now() & PEER_GONE_EVENTS)

    def has_unread_bytes(self) -> bool:
        """True when bytes of a message wait here or in the socket (not when only an end of
        file or a failed link does); never waits."""
        if self._end > self._start:
            return True
        if not self._events_now() & select.POLLIN:
            return False
        try:  # readable, so this returns at once: data, or b"" at the end of the stream
            return bool(self._socket.recv(1, socket.MSG_PEEK))
        except OSError:  # the link failed
            return False

    def _events_now(self) -> int:
        poller = select.poll()
        poller.register(self._socket, select.POLLIN | PEER_GONE_EVENTS)
        return sum(events for _, events in poller.poll(0))

    def close(self) -> None:
        self._socket.close()

    def _require_intact(self) -> None:
        if self._broken is not None:
            raise PipeBrokenError(f"the pipe is out of step and refuses use: {self._broken}")

    def _fill(self, num_bytes: int, header_bytes: int = 0) -> None:
        """Reads until the buffer holds the next `num_bytes` (<= its size) of the stream and not
        a byte more, consuming nothing: a timeout here leaves the stream as it was. An end of
        file is reported in bytes of the payload that follows `header_bytes`."""
        buffered = self._end - self._start
        if buffered >= num_bytes:
            return
        self._buffer[:buffered] = self._buffer[self._start : self._end]
        self._start, self._end = 0, buffered
        while self._end < num_bytes:
            view = self._buffer_view[self._end : num_bytes]
            self._end += self._read_some(view, self._end - header_bytes, num_bytes - header_bytes)

    def _read_large(self, num_bytes: int) -> bytearray:
        """The next `num_bytes` (more than the buffer holds): what is buffered (at most the
        header's worth, since reads stop at a message's end), then the socket."""
        buffered = self._end - self._start
        data = bytearray(num_bytes)
        data[:buffered] = self._buffer[self._start : self._end]
        self._start = self._end = 0
        view = memoryview(data)
        while buffered < num_bytes:
            buffered += self._read_some(view[buffered:], buffered, num_bytes)
        return data

    def _read_some(self, view: memoryview, num_filled: int, num_wanted: int) -> int:
        """One read into `view`; end of file raises PeerClosedError, with how far the wanted
        bytes had come when it is mid-message."""
        try:
            num_read = self._socket.recv_into(view)
        except ConnectionResetError as exc:
            raise PeerClosedError("the other end of the pipe is closed") from exc
        except OSError as exc:
            if (peer_gone := _peer_gone_error(exc)) is not None:
                raise peer_gone from exc
            raise
        if num_read == 0:
            raise PeerClosedError(
                "the other end of the pipe closed"
                + (f" after {num_filled} of {num_wanted} bytes" if num_filled else "")
            )
        return num_read


def pipe_pair(timeout_s: float | None = None) -> tuple[MessagePipe, socket.socket]:
    """This process's pipe end and the raw socket to hand to a child (then close it here)."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_end.set_inheritable(True)
    return MessagePipe(parent_end, timeout_s), child_end


def configure_tcp_link(sock: socket.socket) -> None:
    """Tunes a connected TCP socket for the core <-> worker link: no Nagle delay (a step is one
    small message each way), and a dead peer host reported within DEAD_PEER_TIMEOUT_S, idle
    (keepalive probes) or not (a user timeout on unacknowledged data). Options the platform
    lacks are skipped."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", DEAD_PEER_TIMEOUT_S * 1000),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
