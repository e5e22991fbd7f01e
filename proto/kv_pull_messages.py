"""The TcpConnector's link: a consumer's worker pulling KV blocks from a producer's block server.

One connection per pull. Each message is a frame: its length (u32, little endian), then its
msgpack bytes.

    consumer -> producer   KVPull (or KVRelease alone, to free blocks it does not need)
    producer -> consumer   KVPullReply, then `num_payload_bytes` raw bytes when `error` is None
    consumer -> producer   KVRelease: the blocks may be freed (sent after a refused pull too)

The payload is the blocks in the order asked, each [layer, K/V, token, head, dim] in C order
(`worker.kv_connector.kv_block_layout.KVBlockLayout`). Both sides compare layouts (the JSON
of each side's `KVBlockLayout`): bytes of another model, dtype, block size or shape are never
sent, nor used.
"""

from __future__ import annotations

import struct

import msgspec

FRAME_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 24  # a pull names at most a few thousand blocks


class KVPull(msgspec.Struct, tag="pull", array_like=True, gc=False):
    """Send the blocks `block_ids` the producer holds for `request_id`; `block_hashes` are
    what the consumer expects each to hold (transfer hashes), `layout` its own layout JSON."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    layout: str


class KVRelease(msgspec.Struct, tag="release", array_like=True, gc=False):
    """The consumer is done with `request_id`'s blocks."""

    engine_id: str
    request_id: str


class KVPullReply(msgspec.Struct, array_like=True, gc=False):
    """`error` says why nothing follows (unknown request, another engine, a block whose hash
    differs, another layout); else `num_payload_bytes` of blocks follow."""

    layout: str
    num_payload_bytes: int = 0
    error: str | None = None


ConsumerMessage = KVPull | KVRelease


def encode_frame(message: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(message)
    return FRAME_LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame's 4-byte header announces; ValueError beyond MAX_FRAME_BYTES."""
    (length,) = FRAME_LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a KV pull frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length
