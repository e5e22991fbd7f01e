"""MessagePipe: framing, large messages, a closed peer, timeouts, and a real child process."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from core_engine.proto import MessageDecoder, MessageEncoder, SchedulerOutput, Shutdown
from core_engine.proto.message_pipe import (
    HEADER,
    READ_BUFFER_BYTES,
    MessagePipe,
    PayloadTooLargeError,
    PeerClosedError,
    PipeBrokenError,
    configure_tcp_link,
    pipe_pair,
)


@pytest.fixture
def pipes():
    """Two connected pipe ends, both waiting at most 5 s."""
    left_socket, right_socket = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = MessagePipe(left_socket, 5.0), MessagePipe(right_socket, 5.0)
    yield left, right
    left.close()
    right.close()


def test_messages_arrive_whole_and_in_order_and_decode(pipes):
    left, right = pipes
    encoder = MessageEncoder()
    decoder = MessageDecoder([SchedulerOutput, Shutdown])
    step = SchedulerOutput([], [], {"a": 3}, total_num_scheduled_tokens=3)
    for message in (step, Shutdown(), step):
        left.send(encoder.encode(message))
    assert [decoder.decode(right.recv()) for _ in range(3)] == [step, Shutdown(), step]


def test_a_read_stops_at_the_message_end_so_a_poll_sees_the_next(pipes):
    """Two messages sent together: after the first `recv` the second is still in the socket,
    so a poll reports it (a poller needs no other look at the pipe)."""
    left, right = pipes
    left.send([b"\x01", b"first"])
    left.send([b"\x02", b"second"])
    time.sleep(0.05)  # both are in the socket before the first read
    assert bytes(right.recv()[1]) == b"first"
    assert select.select([right], [], [], 0)[0] == [right]
    assert bytes(right.recv()[1]) == b"second"
    assert select.select([right], [], [], 0)[0] == []


def test_an_empty_payload_is_a_message(pipes):
    left, right = pipes
    left.send([b"\x07", b""])
    code, payload = right.recv()
    assert bytes(code) == b"\x07" and bytes(payload) == b""


def test_messages_larger_than_the_buffers_arrive_whole_between_small_ones(pipes):
    """8 MiB fits neither the kernel's socket buffer nor the pipe's read buffer: the send ends
    only as the reader drains it, and the small messages around it keep their bytes."""
    left, right = pipes
    payloads = [b"before", os.urandom(8 * 1024 * 1024), b"after", os.urandom(70_000), b"end"]
    received = []
    reader = threading.Thread(target=lambda: received.extend(right.recv() for _ in payloads))
    reader.start()
    for index, payload in enumerate(payloads):
        left.send([bytes((index,)), payload])
    reader.join(10)
    assert [(bytes(code), bytes(body)) for code, body in received] == [
        (bytes((index,)), payload) for index, payload in enumerate(payloads)
    ]


def test_a_closed_peer_fails_recv_and_send_with_peer_closed_error(pipes):
    left, right = pipes
    right.close()
    with pytest.raises(PeerClosedError, match="closed"):
        left.recv()
    with pytest.raises(PeerClosedError):
        for _ in range(2):  # the first send may still land in the buffer of a closing socket
            left.send([b"\x01", b"x" * 1024])


def test_a_peer_that_closes_mid_message_is_reported_with_the_byte_counts():
    left_socket, right_socket = socket.socketpair()
    pipe = MessagePipe(left_socket, 5.0)
    right_socket.sendall(HEADER.pack(100, 1) + b"x" * 40)
    right_socket.close()
    with pytest.raises(PeerClosedError, match="after 40 of 100 bytes"):
        pipe.recv()
    pipe.close()


def test_a_silent_peer_times_out(pipes):
    left, right = pipes
    left.timeout_s = 0.05
    with pytest.raises(TimeoutError):
        left.recv()
    assert left.timeout_s == 0.05


def test_a_full_pipe_times_out_instead_of_blocking_forever(pipes):
    left, _ = pipes
    left.timeout_s = 0.05
    with pytest.raises(TimeoutError):
        left.send([b"\x01", b"x" * (64 * 1024 * 1024)])  # nobody reads


def test_a_recv_that_times_out_inside_a_small_message_can_be_retried():
    left_socket, right_socket = socket.socketpair()
    pipe = MessagePipe(left_socket, 0.05)
    right_socket.sendall(HEADER.pack(100, 7) + b"x" * 40)
    with pytest.raises(TimeoutError):
        pipe.recv()
    right_socket.sendall(b"y" * 60 + HEADER.pack(1, 3) + b"z")
    assert pipe.recv() == [b"\x07", bytearray(b"x" * 40 + b"y" * 60)]
    assert pipe.recv() == [b"\x03", bytearray(b"z")]
    pipe.close()
    right_socket.close()


def test_a_recv_that_times_out_inside_a_large_message_breaks_the_pipe():
    left_socket, right_socket = socket.socketpair()
    pipe = MessagePipe(left_socket, 0.05)
    size = 4 * READ_BUFFER_BYTES
    right_socket.sendall(HEADER.pack(size, 7) + b"x" * (size // 2))
    with pytest.raises(TimeoutError):
        pipe.recv()
    right_socket.sendall(b"x" * (size // 2))
    with pytest.raises(PipeBrokenError, match=f"a recv timed out inside a {size}-byte message"):
        pipe.recv()
    with pytest.raises(PipeBrokenError):
        pipe.send([b"\x01", b"ping"])
    pipe.close()
    right_socket.close()


def test_a_send_that_times_out_part_way_breaks_the_pipe(pipes):
    left, right = pipes
    left.timeout_s = 0.05
    with pytest.raises(TimeoutError):
        left.send([b"\x01", b"x" * (64 * 1024 * 1024)])  # nobody reads: part of it is sent
    with pytest.raises(PipeBrokenError, match="a send timed out after at least"):
        left.send([b"\x01", b"ping"])


def test_bad_frames_are_refused_before_anything_is_sent(pipes):
    left, right = pipes
    with pytest.raises(ValueError, match="a type code is 1 byte, got 2"):
        left.send([b"\x01\x02", b"x"])
    with pytest.raises(ValueError):
        left.send([b"\x01"])
    right.timeout_s = 0.01
    with pytest.raises(TimeoutError):
        right.recv()  # nothing half-written is waiting


CHILD_ECHO = """
import sys
from core_engine.proto.message_pipe import MessagePipe, PeerClosedError
pipe = MessagePipe.from_fd(int(sys.argv[1]))
try:
    while True:
        code, payload = pipe.recv()
        pipe.send([code, bytes(payload)[::-1]])
except PeerClosedError:
    sys.exit(3)
"""


def test_a_child_process_answers_over_its_inherited_end_and_sees_the_parent_close():
    pipe, child_end = pipe_pair(timeout_s=10.0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_ECHO, str(child_end.fileno())], pass_fds=[child_end.fileno()]
    )
    child_end.close()
    try:
        pipe.send([b"\x02", b"hello"])
        code, payload = pipe.recv()
        assert bytes(code) == b"\x02" and bytes(payload) == b"olleh"
    finally:
        pipe.close()
    assert child.wait(10) == 3  # end of file, not a hang


def test_a_child_that_dies_closes_the_pipe_at_once():
    pipe, child_end = pipe_pair(timeout_s=10.0)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[child_end.fileno()]
    )
    child_end.close()
    try:
        child.kill()
        with pytest.raises(PeerClosedError):
            pipe.recv()
    finally:
        child.wait()
        pipe.close()


@pytest.fixture
def tcp_pipes():
    """Two ends of a loopback TCP connection set up as the core <-> remote worker link."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    for sock in (client, accepted):
        configure_tcp_link(sock)
    left, right = MessagePipe(client, 5.0), MessagePipe(accepted, 5.0)
    yield left, right
    left.close()
    right.close()


def test_the_same_framing_runs_over_tcp_and_a_closed_peer_is_seen_without_a_read(tcp_pipes):
    left, right = tcp_pipes
    left.send([b"\x03", b"last words"])
    assert not right.peer_closed()
    left.close()
    deadline = time.monotonic() + 5
    while not right.peer_closed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert right.peer_closed() and right.has_unread_bytes()  # closed, but a message waits
    code, payload = right.recv()
    assert (bytes(code), bytes(payload)) == (b"\x03", b"last words")
    assert not right.has_unread_bytes()  # only the end of the stream is left
    with pytest.raises(PeerClosedError):
        right.recv()


def test_a_header_announcing_more_than_the_caller_accepts_is_refused_unread(tcp_pipes):
    left, right = tcp_pipes
    left.send([b"\x01", b"x" * 100])
    with pytest.raises(PayloadTooLargeError, match="announced 100 bytes, over the limit of 99"):
        right.recv(max_payload_bytes=99)
    with pytest.raises(PipeBrokenError):
        right.recv()
