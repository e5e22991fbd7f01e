"""`KVTransferParams`: the prefill/decode handshake that rides on a request and its response
(vLLM's `kv_transfer_params`, with vLLM's field names).

1. The router sends the prompt to the prefill instance with `{"do_remote_decode": true}` (and
   max_tokens 1). That instance computes the prompt, holds its KV blocks, and answers with
   `{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port",
   "remote_request_id", "remote_block_ids", "remote_block_hashes"}`: where to pull the blocks
   from, which ones, and what each holds.
2. The router sends the request to the decode instance with those params. It pulls the blocks
   over TCP (`proto.kv_pull_messages`), tells the prefill instance it is done, and decodes.

`remote_block_hashes` are the prompt's transfer hashes (hex; `common.block_hash.
transfer_block_hashes`): seed-free, so both instances compute the same ones for the same
tokens; a block whose hash differs from the decode side's own is never pulled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from core_engine.proto.parameter_error import ParameterError


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Validated on construction and on decode; at most one of `do_remote_decode` (asked of a
    prefill instance) and `do_remote_prefill` (given to a decode instance) is set."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] = msgspec.field(default_factory=list)
    remote_block_hashes: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError(
                "kv_transfer_params: do_remote_decode (ask a prefill instance) and "
                "do_remote_prefill (give its answer to a decode instance) exclude each other"
            )
        if self.do_remote_prefill:
            self._check_remote_prefill()

    def _check_remote_prefill(self) -> None:
        for name in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id"):
            if getattr(self, name) is None:
                raise ValueError(f"kv_transfer_params.{name} is required with do_remote_prefill")
        if not 0 < self.remote_port < 65536:
            raise ValueError(
                f"kv_transfer_params.remote_port must be in [1, 65535], got {self.remote_port}"
            )
        if len(self.remote_block_ids) != len(self.remote_block_hashes):
            raise ValueError(
                f"kv_transfer_params has {len(self.remote_block_ids)} remote_block_ids but "
                f"{len(self.remote_block_hashes)} remote_block_hashes: one hash per block"
            )
        for block_hash in self.remote_block_hashes:
            if len(block_hash) != 32 or not _is_hex(block_hash):
                raise ValueError(
                    "kv_transfer_params.remote_block_hashes must be 32 hex digits each, got "
                    f"{block_hash!r}"
                )

    @property
    def block_hashes(self) -> list[bytes]:
        return [bytes.fromhex(h) for h in self.remote_block_hashes]

    @classmethod
    def parse(cls, value: dict[str, Any] | KVTransferParams | None) -> KVTransferParams | None:
        """From a JSON object (a request body's field); ParameterError ("kv_transfer_params",
        a 400 for an HTTP client) says what in it is wrong."""
        if value is None or isinstance(value, KVTransferParams):
            return value
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ParameterError(
                "kv_transfer_params", f"kv_transfer_params is invalid: {exc}"
            ) from exc

    def to_json_object(self) -> dict[str, Any]:
        """The response field: every field set (defaults left out)."""
        return msgspec.to_builtins(self)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
