"""The worker side of the connector `EngineConfig.kv_transfer_config` names."""

from __future__ import annotations

import torch

from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.kv_transfer import TCP_CONNECTOR
from core_engine.worker.kv_connector.disk_kv_tier import DiskKVTier
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout
from core_engine.worker.kv_connector.offloading_connector_worker import OffloadingConnectorWorker
from core_engine.worker.kv_connector.tcp_connector_worker import TcpConnectorWorker

GIB = 2**30


def make_kv_connector_worker(
    config: EngineConfig,
    layout: KVBlockLayout,
    dtype: torch.dtype,
    device: torch.device,
) -> OffloadingConnectorWorker | TcpConnectorWorker | None:
    """None without `kv_transfer_config`; the tier budgets are split evenly over the ranks."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return None
    if transfer.kv_connector == TCP_CONNECTOR:
        return TcpConnectorWorker(transfer, layout, dtype, device)
    world_size = layout.tp_size
    disk = None
    disk_bytes = 0.0
    if config.kv_offloading_path is not None:
        disk = DiskKVTier(config.kv_offloading_path, layout)
        disk_bytes = transfer.disk_size_gib * GIB / world_size
    return OffloadingConnectorWorker(
        layout,
        dtype,
        device,
        host_bytes=config.kv_offloading_size * GIB / world_size,
        disk=disk,
        disk_bytes=disk_bytes,
        world_size=world_size,
    )
