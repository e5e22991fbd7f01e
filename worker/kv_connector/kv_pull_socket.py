"""Frames of `proto.kv_pull_messages` over a blocking socket (with its timeout set)."""

from __future__ import annotations

import socket

import msgspec

from core_engine.proto.kv_pull_messages import FRAME_LENGTH, encode_frame, frame_length


class KVPullClosedError(ConnectionError):
    """The peer closed the connection before a whole frame or payload arrived."""


def send_message(sock: socket.socket, message: msgspec.Struct) -> None:
    sock.sendall(encode_frame(message))


def receive_message(sock: socket.socket, decoder: msgspec.msgpack.Decoder):
    """One frame, decoded; KVPullClosedError when the peer hung up, ValueError when it sent
    something else (msgspec.DecodeError is a ValueError)."""
    length = frame_length(bytes(receive_exactly(sock, FRAME_LENGTH.size)))
    return decoder.decode(receive_exactly(sock, length))


def receive_exactly(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    received = 0
    while received < num_bytes:
        count = sock.recv_into(view[received:], num_bytes - received)
        if count == 0:
            raise KVPullClosedError(f"connection closed after {received} of {num_bytes} bytes")
        received += count
    return buffer
