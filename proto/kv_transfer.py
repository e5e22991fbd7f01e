"""The KV connector's config and messages: what moves KV blocks beyond the device's pool.

`KVTransferConfig` is vLLM's `kv_transfer_config` (`{"kv_connector": ..., "kv_role": ...,
"kv_connector_extra_config": {...}}`). Per step, the scheduler side of the connector ships its
`KVConnectorMetadata` with the `SchedulerOutput`; rank 0 answers with a `KVConnectorOutput` in
the `ModelRunnerOutput`. At start-up each worker describes its side in a `KVConnectorHandshake`
(inside `WorkerReady`).

Block hashes travel as the 16 raw bytes of `common.block_hash.BlockHash`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from core_engine.proto.json_struct import parse_json_struct

OFFLOADING_CONNECTOR = "OffloadingConnector"
TCP_CONNECTOR = "TcpConnector"
KV_CONNECTORS = (OFFLOADING_CONNECTOR, TCP_CONNECTOR)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# kv_connector_extra_config keys each connector accepts, with what they mean.
OFFLOADING_EXTRA_KEYS = {
    "disk_size_gib": "bound of the disk tier (kv_offloading_path), all ranks together",
}
DEFAULT_DISK_SIZE_GIB = 16.0
TCP_EXTRA_KEYS = {
    "host": "address the producer's block server listens on and advertises (default 127.0.0.1)",
    "port": "its TCP port (default 0: a free port, advertised in kv_transfer_params)",
    "send_timeout_s": "how long a producer holds blocks no consumer pulls (default 120)",
    "pull_timeout_s": "a consumer's limit on connecting and on each read (default 10)",
}
TCP_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "send_timeout_s": 120.0,
    "pull_timeout_s": 10.0,
}


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which connector runs and in what role; validated on construction (and so on decode).

    The OffloadingConnector both saves and loads, so its role is "kv_both"; its extra config
    takes `disk_size_gib` (default DEFAULT_DISK_SIZE_GIB) and nothing else.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            self.kv_connector in KV_CONNECTORS,
            f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, "
            f"got {self.kv_connector!r}",
        )
        _check(
            self.kv_role in KV_ROLES,
            f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}",
        )
        if self.kv_connector == OFFLOADING_CONNECTOR:
            self._check_offloading()
        if self.kv_connector == TCP_CONNECTOR:
            self._check_tcp()

    def _check_offloading(self) -> None:
        _check(
            self.kv_role == "kv_both",
            f"kv_transfer_config.kv_role must be 'kv_both' for {OFFLOADING_CONNECTOR} (it saves "
            f"and loads), got {self.kv_role!r}",
        )
        unknown = sorted(set(self.kv_connector_extra_config) - set(OFFLOADING_EXTRA_KEYS))
        _check(
            not unknown,
            f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; "
            f"{OFFLOADING_CONNECTOR} takes {sorted(OFFLOADING_EXTRA_KEYS)}",
        )
        size = self.disk_size_gib
        _check(
            isinstance(size, int | float) and size > 0,
            "kv_transfer_config.kv_connector_extra_config.disk_size_gib must be a positive "
            f"number, got {size!r}",
        )

    def _check_tcp(self) -> None:
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - set(TCP_EXTRA_KEYS))
        _check(
            not unknown,
            f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; "
            f"{TCP_CONNECTOR} takes {sorted(TCP_EXTRA_KEYS)}",
        )
        prefix = "kv_transfer_config.kv_connector_extra_config."
        _check(
            isinstance(self.tcp_option("host"), str) and self.tcp_option("host"),
            f"{prefix}host must be a non-empty string, got {self.tcp_option('host')!r}",
        )
        port = self.tcp_option("port")
        _check(
            isinstance(port, int) and 0 <= port < 65536,
            f"{prefix}port must be in [0, 65535] (0: any free port), got {port!r}",
        )
        for name in ("send_timeout_s", "pull_timeout_s"):
            value = self.tcp_option(name)
            _check(
                isinstance(value, int | float) and value > 0,
                f"{prefix}{name} must be a positive number of seconds, got {value!r}",
            )

    def tcp_option(self, name: str) -> Any:
        """A TcpConnector option, its default when not given."""
        return self.kv_connector_extra_config.get(name, TCP_DEFAULTS[name])

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def disk_size_gib(self) -> float:
        return self.kv_connector_extra_config.get("disk_size_gib", DEFAULT_DISK_SIZE_GIB)

    @classmethod
    def offloading(cls) -> KVTransferConfig:
        """What `kv_offloading_size` alone implies (vLLM's native offloading)."""
        return cls(kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both")

    @classmethod
    def parse(
        cls, value: KVTransferConfig | dict[str, Any] | str | None
    ) -> KVTransferConfig | None:
        """From a config, a dict, or JSON text (the CLI flag); None stays None. Raises
        ValueError naming the field that is wrong."""
        return parse_json_struct(cls, value, "kv_transfer_config")


class BlockLoad(msgspec.Struct, array_like=True, gc=False):
    """Fill device block `block_id` from host slot `host_slot`, or, with `disk_hash`, from that
    block's file (into `host_slot` too when one is given: the disk block is promoted)."""

    block_id: int
    host_slot: int | None = None
    disk_hash: bytes | None = None


class RequestLoad(msgspec.Struct, array_like=True, gc=False):
    """One request's blocks to load; the request waits (WAITING_FOR_REMOTE_KVS) until the
    workers report it in `KVConnectorOutput.finished_recving` or `failed_recving`."""

    req_id: str
    blocks: list[BlockLoad]


class BlockStore(msgspec.Struct, array_like=True, gc=False):
    """Copy device block `block_id`, computed by the end of this step, to host slot
    `host_slot`; with `disk_hash`, write it to that block's file as well."""

    block_id: int
    host_slot: int | None = None
    disk_hash: bytes | None = None


class OffloadingConnectorMetadata(msgspec.Struct, array_like=True, gc=False, tag="offloading"):
    """One step's work for the OffloadingConnector's worker side.

    Loads run while the step's forward runs and are finished before the step is answered, on
    every rank; stores copy blocks the forward computed, after it. Host slots named here are
    not reassigned within the step. `disk_deletes`: files to remove (the disk tier's LRU
    evictions), after this step's writes.
    """

    loads: list[RequestLoad] = msgspec.field(default_factory=list)
    stores: list[BlockStore] = msgspec.field(default_factory=list)
    disk_deletes: list[bytes] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.disk_deletes)


class RequestSend(msgspec.Struct, array_like=True, gc=False):
    """A finished request whose prompt blocks the producer's block server serves: device blocks
    `block_ids`, their transfer hashes `block_hashes` (one each), until a consumer releases
    them or `send_timeout_s` passes; then the request is reported in `finished_sending`."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


class RequestPull(msgspec.Struct, array_like=True, gc=False):
    """Pull the blocks a producer holds for `remote_request_id` into device blocks
    `local_block_ids` (in order: remote block i -> local block i, the transfer hash of each in
    `block_hashes`), then release them. With no blocks it only releases them (the consumer
    needs none: a local prefix hit covered them, or the request ended first)."""

    req_id: str
    host: str
    port: int
    engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    block_hashes: list[bytes]


class TcpConnectorMetadata(msgspec.Struct, array_like=True, gc=False, tag="tcp"):
    """One step's work for the TcpConnector's worker side: blocks to serve (producer) and to
    pull (consumer); pulls run in the background over several steps. `idle`: the step runs no
    request, so the worker may wait a little for a transfer to end rather than spin."""

    sends: list[RequestSend] = msgspec.field(default_factory=list)
    pulls: list[RequestPull] = msgspec.field(default_factory=list)
    idle: bool = False


# One member per connector.
KVConnectorMetadata = OffloadingConnectorMetadata | TcpConnectorMetadata


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Rank 0's report of one step's transfers.

    `finished_recving`: requests whose blocks are loaded (on every rank). `failed_recving`:
    requests whose load failed (a block file missing, truncated or of another layout): their
    loaded tokens must be computed instead. `invalid_block_hashes`: hashes the tiers must
    forget. `finished_sending`: requests whose blocks the connector no longer needs (freed
    later than usual, see `request_finished`). The byte and second counts are this step's.
    """

    finished_sending: list[str] = msgspec.field(default_factory=list)
    finished_recving: list[str] = msgspec.field(default_factory=list)
    failed_recving: list[str] = msgspec.field(default_factory=list)
    invalid_block_hashes: list[bytes] = msgspec.field(default_factory=list)
    num_bytes_loaded: int = 0
    num_bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


class KVConnectorHandshake(msgspec.Struct, array_like=True, gc=False):
    """A worker's side of the connector at start-up: the bytes of one block on this rank, how
    many blocks its host tier and its disk tier hold, and the blocks already on its disk (from
    an earlier run; least recently written first); for the TcpConnector, its block server."""

    bytes_per_block: int
    num_host_blocks: int
    num_disk_blocks: int = 0
    disk_block_hashes: list[bytes] = msgspec.field(default_factory=list)
    # TcpConnector, a producer: where its block server listens, and its engine id (a new one
    # per start, so a restarted producer never serves a pull meant for its predecessor).
    transfer_host: str = ""
    transfer_port: int = 0
    engine_id: str = ""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
