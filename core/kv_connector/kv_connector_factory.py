"""The scheduler side of the connector `EngineConfig.kv_transfer_config` names, built from the
workers' handshakes at start-up."""

from __future__ import annotations

import logging
import os

from core_engine.common.block_hash import PREFIX_HASH_SEED_ENV, BlockHash
from core_engine.common.config_error import ConfigError
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_connector.offloading_connector import OffloadingConnector
from core_engine.core.kv_connector.tcp_connector import TcpConnector
from core_engine.core.kv_connector.tier_index import TierIndex
from core_engine.proto import WorkerReady
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.kv_transfer import TCP_CONNECTOR, KVConnectorHandshake

logger = logging.getLogger(__name__)


def make_kv_connector(
    config: EngineConfig, readies: list[WorkerReady], kv_cache_config: KVCacheConfig
) -> OffloadingConnector | TcpConnector | None:
    """None without `kv_transfer_config`. ConfigError for a model with several KV cache groups
    (sliding-window layers): the tiers hold one full-attention block per hash, so a hybrid
    model runs the connector only with `disable_hybrid_kv_cache` (one group of every layer)."""
    if config.kv_transfer_config is None:
        return None
    if kv_cache_config.num_groups > 1:
        raise ConfigError(
            f"kv_transfer_config: {config.kv_transfer_config.kv_connector} serves models whose "
            f"layers share one KV cache group, but this model has {kv_cache_config.num_groups} "
            "(sliding-window and full-attention layers); pass --disable-hybrid-kv-cache to give "
            "every layer one group"
        )
    handshakes = [_handshake(ready) for ready in readies]
    if config.kv_transfer_config.kv_connector == TCP_CONNECTOR:
        connector = TcpConnector(config.kv_transfer_config, config.block_size, handshakes[0])
    else:
        connector = _offloading_connector(config, handshakes)
    logger.info(connector.describe())
    return connector


def _offloading_connector(
    config: EngineConfig, handshakes: list[KVConnectorHandshake]
) -> OffloadingConnector:
    bytes_per_block = sum(h.bytes_per_block for h in handshakes)
    host = TierIndex(_num_blocks("kv_offloading_size", config.kv_offloading_size, handshakes))
    disk = None
    if config.kv_offloading_path is not None:
        disk_size_gib = config.kv_transfer_config.disk_size_gib
        disk = TierIndex(_num_blocks("disk_size_gib", disk_size_gib, handshakes, disk=True))
        disk.add_oldest_first(_blocks_on_every_disk(handshakes))
        _log_disk_tier(config.kv_offloading_path, len(disk), disk.capacity)
    return OffloadingConnector(config.block_size, bytes_per_block, host, disk)


def _handshake(ready: WorkerReady) -> KVConnectorHandshake:
    if ready.kv_connector_handshake is None:
        raise ValueError(f"worker rank {ready.rank} did not set up the KV connector")
    return ready.kv_connector_handshake


def _num_blocks(
    name: str, size_gib: float, handshakes: list[KVConnectorHandshake], disk: bool = False
) -> int:
    """The blocks every rank's tier holds; ConfigError when that is none."""
    num_blocks = min(h.num_disk_blocks if disk else h.num_host_blocks for h in handshakes)
    if num_blocks < 1:
        bytes_per_block = sum(h.bytes_per_block for h in handshakes)
        raise ConfigError(
            f"{name}={size_gib} GiB holds no KV block: one block takes {bytes_per_block} bytes "
            f"over the {len(handshakes)} rank(s); give it at least {bytes_per_block / 2**30:.6f}"
        )
    return num_blocks


def _blocks_on_every_disk(handshakes: list[KVConnectorHandshake]) -> list[BlockHash]:
    """Rank 0's disk blocks (least recently written first) that every other rank has too."""
    common = set(handshakes[0].disk_block_hashes)
    for handshake in handshakes[1:]:
        common &= set(handshake.disk_block_hashes)
    return [BlockHash(h) for h in handshakes[0].disk_block_hashes if h in common]


def _log_disk_tier(path: str, num_found: int, capacity: int) -> None:
    logger.info(
        "KV disk tier at %s: %d blocks from earlier runs, room for %d", path, num_found, capacity
    )
    if not os.environ.get(PREFIX_HASH_SEED_ENV):
        logger.warning(
            "%s is not set: block hashes are seeded at random, so the KV disk tier at %s is "
            "useful to this run only (set it to 32 hex digits to reuse blocks after a restart)",
            PREFIX_HASH_SEED_ENV,
            path,
        )
