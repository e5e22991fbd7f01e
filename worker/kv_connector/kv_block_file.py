"""One offloaded KV block on disk: a header that says what the bytes are, then the bytes.

    b"CEKVBLK1" | header length (u32, little endian) | header (JSON) | payload

The header holds the `KVBlockLayout`, the block's hash (hex) and the payload's length and
xxh3-64 checksum. A file is written under a temporary name, fsynced and renamed, so a file with
the final name is whole unless something damaged it later; `read_block_file` checks all of it
anyway and raises `KVBlockFileError` rather than return bytes that are not this block of this
layout.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import xxhash

from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout

MAGIC = b"CEKVBLK1"
MAX_HEADER_BYTES = 1 << 16
_LENGTH = struct.Struct("<I")
SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


class KVBlockFileError(ValueError):
    """A block file that must not be loaded: missing, truncated, corrupt, or of another layout."""


def block_file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def write_block_file(path: Path, layout: KVBlockLayout, block_hash: bytes, payload: bytes) -> None:
    """Writes atomically: a temporary file in the same folder, fsynced, renamed to `path`."""
    header = {
        "layout": json.loads(layout.to_json()),
        "block_hash": block_hash.hex(),
        "payload_bytes": len(payload),
        "payload_xxh3_64": xxhash.xxh3_64_hexdigest(payload),
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    temp_path = path.with_name(f"{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    with open(temp_path, "wb") as file:
        file.write(MAGIC + _LENGTH.pack(len(header_bytes)) + header_bytes)
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp_path, path)


def read_block_header(path: Path, layout: KVBlockLayout, block_hash: bytes) -> tuple[dict, int]:
    """The header of `path` and where its payload starts, once the header says the file is
    `block_hash` in `layout` and the file's size matches; KVBlockFileError otherwise."""
    try:
        with open(path, "rb") as file:
            prefix = file.read(len(MAGIC) + _LENGTH.size)
            if len(prefix) < len(MAGIC) + _LENGTH.size or not prefix.startswith(MAGIC):
                raise KVBlockFileError(f"{path.name}: not a KV block file")
            (header_length,) = _LENGTH.unpack(prefix[len(MAGIC) :])
            if header_length > MAX_HEADER_BYTES:
                raise KVBlockFileError(f"{path.name}: header of {header_length} bytes")
            header_bytes = file.read(header_length)
            size = os.fstat(file.fileno()).st_size
    except OSError as exc:
        raise KVBlockFileError(f"{path.name}: {exc.strerror or exc}") from exc
    header = _parse_header(path, header_bytes)
    _check_header(path, header, layout, block_hash)
    payload_start = len(prefix) + header_length
    if size != payload_start + header["payload_bytes"]:
        raise KVBlockFileError(
            f"{path.name}: {size} bytes, but the header promises "
            f"{payload_start + header['payload_bytes']} (truncated?)"
        )
    return header, payload_start


def _parse_header(path: Path, header_bytes: bytes) -> dict:
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KVBlockFileError(f"{path.name}: unreadable header ({exc})") from exc
    if not isinstance(header, dict) or not isinstance(header.get("payload_bytes"), int):
        raise KVBlockFileError(f"{path.name}: header without payload_bytes")
    return header


def _check_header(path: Path, header: dict, layout: KVBlockLayout, block_hash: bytes) -> None:
    expected = json.loads(layout.to_json())
    found = header.get("layout")
    if found != expected:
        differing = sorted(
            key
            for key in expected
            if not isinstance(found, dict) or found.get(key) != expected[key]
        )
        raise KVBlockFileError(f"{path.name}: another layout (differs in {differing})")
    if header.get("block_hash") != block_hash.hex():
        raise KVBlockFileError(f"{path.name}: holds block {header.get('block_hash')}")
    expected_bytes = layout.num_elements * _itemsize(layout.dtype)
    if header["payload_bytes"] != expected_bytes:
        raise KVBlockFileError(
            f"{path.name}: payload of {header['payload_bytes']} bytes, the layout has "
            f"{expected_bytes}"
        )


def read_block_file(path: Path, layout: KVBlockLayout, block_hash: bytes) -> bytes:
    """The payload of `path`, checked whole against its header and checksum."""
    header, payload_start = read_block_header(path, layout, block_hash)
    try:
        with open(path, "rb") as file:
            file.seek(payload_start)
            payload = file.read()
    except OSError as exc:
        raise KVBlockFileError(f"{path.name}: {exc.strerror or exc}") from exc
    if len(payload) != header["payload_bytes"]:
        raise KVBlockFileError(f"{path.name}: payload truncated while reading")
    if xxhash.xxh3_64_hexdigest(payload) != header.get("payload_xxh3_64"):
        raise KVBlockFileError(f"{path.name}: payload checksum mismatch")
    return payload


def _itemsize(dtype_name: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype_name]
