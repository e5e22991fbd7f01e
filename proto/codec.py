"""Wire framing: `[type byte][msgpack payload]`, one typed decoder per socket.

Every message that crosses a process boundary is a Struct listed in `MESSAGE_TYPES`; its index
there is its type byte. Decoding never unpickles, never builds an object of a type the socket
does not accept, and refuses payloads over `max_frame_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from core_engine.proto.engine_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    UtilityRequest,
    UtilityResponse,
)
from core_engine.proto.worker_messages import (
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerHello,
    WorkerReady,
    WorkerRejected,
    WorkerWelcome,
)

MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    EngineCoreRequest,
    AbortRequests,
    UtilityRequest,
    EngineCoreOutputs,
    EngineReady,
    UtilityResponse,
    EngineDead,
    SchedulerOutput,
    ModelRunnerOutput,
    WorkerReady,
    InitKVCache,
    KVCacheReady,
    Shutdown,
    WorkerError,
    WorkerHello,
    WorkerWelcome,
    WorkerRejected,
)
TYPE_TO_CODE: dict[type, bytes] = {t: bytes([i]) for i, t in enumerate(MESSAGE_TYPES)}

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class MessageDecodeError(ValueError):
    """A frame that is not a well-formed message of a type this socket accepts."""


class MessageEncoder:
    """Encodes any message of `MESSAGE_TYPES` to its two frames. Reuses one buffer-free encoder."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: msgspec.Struct) -> list[bytes]:
        code = TYPE_TO_CODE.get(type(message))
        if code is None:
            raise TypeError(f"{type(message).__name__} is not a wire message")
        return [code, self._encoder.encode(message)]


class MessageDecoder:
    """Decodes frames into one of `accepted` message types, or raises `MessageDecodeError`."""

    def __init__(
        self,
        accepted: Sequence[type[msgspec.Struct]],
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._decoders = {TYPE_TO_CODE[t]: msgspec.msgpack.Decoder(t) for t in accepted}
        self.max_frame_bytes = max_frame_bytes

    def decode(self, frames: Sequence[bytes | memoryview]) -> msgspec.Struct:
        if len(frames) != 2:
            raise MessageDecodeError(f"expected 2 frames (type, payload), got {len(frames)}")
        code, payload = bytes(frames[0]), frames[1]
        decoder = self._decoders.get(code)
        if decoder is None:
            raise MessageDecodeError(f"message type {code!r} is not accepted on this socket")
        if len(payload) > self.max_frame_bytes:
            raise MessageDecodeError(
                f"payload of {len(payload)} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        try:
            return decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MessageDecodeError(str(exc)) from exc
