"""`GGUFFile`: the metadata and tensor table of a GGUF file, read in one pass.

The frontend (tokenizer) and the worker (config, weights) both read GGUF metadata at start-up.
gguf-py's `GGUFReader` builds numpy views for every element of every array, about 100,000 for a
49k-token vocabulary and its merges, a cost every process that reads the file pays at start-up;
this reader parses the same metadata with `struct` and builds no views. Tensor data is not read
here: each `GGUFTensorInfo` gives its type and absolute file offset, for the worker to map
lazily.

Format (GGUF v2 and v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
metadata count; each metadata entry is a string key, a u32 value type and the value (an array is
a u32 element type, a u64 count and the elements; a string is a u64 byte length and UTF-8
bytes); each tensor entry is a string name, u32 number of dimensions, u64 per dimension
(fastest-varying first), u32 ggml type and a u64 offset into the data section, which starts at
the next multiple of `general.alignment` (default 32) after the tensor table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
STRING_TYPE = 8
ARRAY_TYPE = 9
BOOL_TYPE = 7
# Value type -> its fixed-size little-endian numpy dtype (strings and arrays are read apart).
SCALAR_DTYPES = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    BOOL_TYPE: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]
    """Dimensions as GGUF stores them, fastest-varying first (numpy's shape reversed)."""
    type_id: int
    """The ggml type (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, ...)."""
    data_offset: int
    """Where the tensor's bytes start in the file."""


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> int, float, bool, str or list) and tensor table.

    Raises FileNotFoundError for a missing file, and ValueError naming the file and the
    problem for anything that is not a complete GGUF v2/v3 header.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            with (
                self.path.open("rb") as file,
                mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer,
            ):
                self._read_header(buffer)
        except (ValueError, OSError, struct.error, IndexError, UnicodeDecodeError) as error:
            raise ValueError(f"{str(self.path)!r} is not a readable GGUF file: {error}") from error

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default` when the file has none."""
        return self.fields.get(key, default)

    def _read_header(self, buffer: mmap.mmap) -> None:
        if buffer[:4] != GGUF_MAGIC:
            raise ValueError(f"it starts with {bytes(buffer[:4])!r}, not {GGUF_MAGIC!r}")
        (self.version,) = U32.unpack_from(buffer, 4)
        if self.version not in SUPPORTED_VERSIONS:
            raise ValueError(f"version {self.version} is not supported (only 2 and 3)")
        num_tensors, num_fields = U64.unpack_from(buffer, 8)[0], U64.unpack_from(buffer, 16)[0]
        reader = _ValueReader(buffer, 24)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = reader.string()
            self.fields[key] = reader.value(reader.u32())
        entries = [_read_tensor_entry(reader) for _ in range(num_tensors)]
        alignment = int(self.fields.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT))
        if alignment <= 0:
            raise ValueError(f"{ALIGNMENT_KEY} must be positive, got {alignment}")
        data_start = -(-reader.position // alignment) * alignment
        self.tensors = [
            GGUFTensorInfo(name, dims, type_id, data_start + offset)
            for name, dims, type_id, offset in entries
        ]


def _read_tensor_entry(reader: _ValueReader) -> tuple[str, tuple[int, ...], int, int]:
    name = reader.string()
    num_dims = reader.u32()
    dims = tuple(reader.u64() for _ in range(num_dims))
    return name, dims, reader.u32(), reader.u64()


class _ValueReader:
    """Reads GGUF values from `buffer` sequentially, starting at `position`."""

    def __init__(self, buffer: mmap.mmap, position: int) -> None:
        self.buffer = buffer
        self.position = position

    def u32(self) -> int:
        (value,) = U32.unpack_from(self.buffer, self.position)
        self.position += 4
        return value

    def u64(self) -> int:
        (value,) = U64.unpack_from(self.buffer, self.position)
        self.position += 8
        return value

    def string(self) -> str:
        length = self.u64()
        end = self.position + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes at byte {self.position} passes the end")
        text = self.buffer[self.position : end].decode("utf-8")
        self.position = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == STRING_TYPE:
            return self.string()
        if value_type == ARRAY_TYPE:
            return self.array()
        values = self._scalars(value_type, 1)
        return values[0]

    def array(self) -> list:
        element_type = self.u32()
        count = self.u64()
        if element_type == STRING_TYPE:
            return [self.string() for _ in range(count)]
        if element_type == ARRAY_TYPE:
            return [self.array() for _ in range(count)]
        return self._scalars(element_type, count)

    def _scalars(self, value_type: int, count: int) -> list:
        dtype = SCALAR_DTYPES.get(value_type)
        if dtype is None:
            raise ValueError(f"unknown value type {value_type} at byte {self.position}")
        values = np.frombuffer(self.buffer, dtype, count, self.position).tolist()
        self.position += dtype.itemsize * count
        return values
