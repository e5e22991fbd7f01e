"""`pull_blocks`: a consumer worker's side of one pull from a producer's `KVBlockServer`
(runs on a background thread; the wire is `proto.kv_pull_messages`)."""

from __future__ import annotations

import socket

import msgspec

from core_engine.proto.kv_pull_messages import KVPull, KVPullReply, KVRelease
from core_engine.proto.kv_transfer import RequestPull
from core_engine.worker.kv_connector.kv_pull_socket import (
    receive_exactly,
    receive_message,
    send_message,
)


class KVPullError(RuntimeError):
    """A pull that gave no usable blocks: the producer is unreachable, died or timed out
    mid-transfer, refused (unknown request, a block of other tokens), or answered with bytes
    of another layout or size. The request computes those tokens itself."""


_REPLY_DECODER = msgspec.msgpack.Decoder(KVPullReply)


def pull_blocks(
    pull: RequestPull, layout: str, bytes_per_block: int, timeout_s: float
) -> bytearray:
    """The bytes of `pull.remote_block_ids` (checked against `layout` and their size), the
    producer told to release them; with no blocks, only the release. Raises KVPullError."""
    try:
        with socket.create_connection((pull.host, pull.port), timeout=timeout_s) as sock:
            if not pull.remote_block_ids:
                send_message(sock, KVRelease(pull.engine_id, pull.remote_request_id))
                return bytearray()
            try:
                return _pull_payload(sock, pull, layout, bytes_per_block)
            finally:
                send_message(sock, KVRelease(pull.engine_id, pull.remote_request_id))
    except (OSError, ValueError) as exc:  # refused, reset, timed out, closed, garbled
        raise KVPullError(
            f"pulling {len(pull.remote_block_ids)} KV blocks of {pull.remote_request_id} from "
            f"{pull.host}:{pull.port} failed: {exc}"
        ) from exc


def _pull_payload(
    sock: socket.socket, pull: RequestPull, layout: str, bytes_per_block: int
) -> bytearray:
    where = f"{pull.host}:{pull.port}"
    request = KVPull(
        pull.engine_id, pull.remote_request_id, pull.remote_block_ids, pull.block_hashes, layout
    )
    send_message(sock, request)
    reply = receive_message(sock, _REPLY_DECODER)
    if reply.error is not None:
        raise KVPullError(f"{where} refused the pull: {reply.error}")
    if reply.layout != layout:
        raise KVPullError(f"{where} holds KV of layout {reply.layout}, this worker {layout}")
    expected = len(pull.remote_block_ids) * bytes_per_block
    if reply.num_payload_bytes != expected:
        raise KVPullError(
            f"{where} offers {reply.num_payload_bytes} bytes for "
            f"{len(pull.remote_block_ids)} blocks of {bytes_per_block}"
        )
    return receive_exactly(sock, expected)
