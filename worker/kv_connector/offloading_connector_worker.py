"""`OffloadingConnectorWorker`: the worker side of the OffloadingConnector. It holds this rank's
host tier (and disk tier) and copies blocks as the step's `OffloadingConnectorMetadata` says.

Loads run on a thread while the step's forward runs (into blocks no scheduled request uses);
`get_finished` waits for them, so a load is done on every rank before any rank answers its step,
and rank 0's report holds for all. A load that cannot be served (its block file missing,
damaged or of another layout) fails its whole request, which the scheduler then computes.
Stores copy blocks after the forward; disk writes are queued to the disk tier's writer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from core_engine.proto.kv_transfer import (
    KVConnectorHandshake,
    KVConnectorOutput,
    OffloadingConnectorMetadata,
    RequestLoad,
)
from core_engine.worker.kv_connector.disk_kv_tier import DiskKVTier
from core_engine.worker.kv_connector.host_kv_tier import (
    HostKVTier,
    block_from_bytes,
    block_to_bytes,
    gather_device_blocks,
    scatter_device_blocks,
)
from core_engine.worker.kv_connector.kv_block_file import KVBlockFileError
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout


class OffloadingConnectorWorker:
    """`host_bytes` / `disk_bytes`: this rank's share of the tiers' budgets; `world_size`
    scales the byte counts reported (every rank moves as many bytes as rank 0)."""

    def __init__(
        self,
        layout: KVBlockLayout,
        dtype: torch.dtype,
        device: torch.device,
        host_bytes: float,
        disk: DiskKVTier | None = None,
        disk_bytes: float = 0.0,
        world_size: int = 1,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.bytes_per_block = layout.num_elements * torch.empty((), dtype=dtype).element_size()
        self.num_host_blocks = int(host_bytes // self.bytes_per_block)
        self.num_disk_blocks = int(disk_bytes // self.bytes_per_block) if disk else 0
        self.disk = disk
        self.world_size = world_size
        self.host: HostKVTier | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._metadata = OffloadingConnectorMetadata()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._load_future: Future | None = None
        self._output = KVConnectorOutput()

    def handshake(self) -> KVConnectorHandshake:
        return KVConnectorHandshake(
            bytes_per_block=self.bytes_per_block,
            num_host_blocks=self.num_host_blocks,
            num_disk_blocks=self.num_disk_blocks,
            disk_block_hashes=self.disk.scan() if self.disk is not None else [],
        )

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if self.host is None and self.num_host_blocks > 0:
            self.host = HostKVTier(self.layout, self.num_host_blocks, self.dtype, self.device)

    def bind_connector_metadata(self, metadata: OffloadingConnectorMetadata | None) -> None:
        self._metadata = metadata if metadata is not None else OffloadingConnectorMetadata()
        self._output = KVConnectorOutput()

    def start_load_kv(self) -> None:
        if self._metadata.loads:
            self._load_future = self._loader.submit(self._load_all, self._metadata.loads)

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing: a loading request is not in the step's batch."""

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """Nothing: blocks are stored whole, after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Copies the blocks the step computed to their host slots and queues their files."""
        stores = self._metadata.stores
        if stores:
            start = time.perf_counter()
            data = gather_device_blocks(self.kv_caches, [s.block_id for s in stores])
            to_host = [i for i, store in enumerate(stores) if store.host_slot is not None]
            if to_host:
                self.host.write_slots([stores[i].host_slot for i in to_host], data[to_host])
            for i, store in enumerate(stores):
                if store.disk_hash is not None:
                    self.disk.write(store.disk_hash, block_to_bytes(data[i]))
            self._output.num_bytes_stored += len(stores) * self.bytes_per_block * self.world_size
            self._output.store_s += time.perf_counter() - start
        for block_hash in self._metadata.disk_deletes:
            self.disk.delete(block_hash)

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        """Waits for the step's loads; (nothing held for sending, the requests loaded)."""
        if self._load_future is not None:
            future, self._load_future = self._load_future, None
            future.result()
        return set(), set(self._output.finished_recving)

    def take_connector_output(self) -> KVConnectorOutput:
        return self._output

    def clear_connector_metadata(self) -> None:
        if self._load_future is not None:  # the step failed: never leave a copy running
            self._load_future.exception()
            self._load_future = None
        self._metadata = OffloadingConnectorMetadata()

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    # ---- loads (on the loader thread) ---------------------------------------------------

    def _load_all(self, loads: list[RequestLoad]) -> None:
        start = time.perf_counter()
        for load in loads:
            try:
                data = self._fetch_blocks(load)
            except KVBlockFileError:
                self._output.failed_recving.append(load.req_id)
                continue
            scatter_device_blocks(self.kv_caches, [b.block_id for b in load.blocks], data)
            self._output.finished_recving.append(load.req_id)
            num_bytes = len(load.blocks) * self.bytes_per_block * self.world_size
            self._output.num_bytes_loaded += num_bytes
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._output.load_s += time.perf_counter() - start

    def _fetch_blocks(self, load: RequestLoad) -> torch.Tensor:
        """The request's blocks, [block, layer, K/V, token, head, dim] on the host; a block
        read from disk also lands in its host slot when it has one. Every block that cannot be
        read is reported invalid (its host slot, if any, was never written), then
        KVBlockFileError is raised."""
        host_slots = [b.host_slot for b in load.blocks if b.disk_hash is None]
        data = self.host.read_slots(host_slots) if host_slots else None
        blocks = []
        next_host = 0
        failure = None
        for block in load.blocks:
            if block.disk_hash is None:
                blocks.append(data[next_host])
                next_host += 1
                continue
            try:
                payload = self.disk.read(block.disk_hash)
            except KVBlockFileError as exc:
                self._output.invalid_block_hashes.append(block.disk_hash)
                failure = exc
                continue
            value = block_from_bytes(payload, self.layout, self.dtype)
            if block.host_slot is not None:
                self.host.write_slots([block.host_slot], value[None])
            blocks.append(value)
        if failure is not None:
            raise failure
        return torch.stack(blocks)
