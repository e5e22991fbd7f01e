"""`OffloadingConnector`, scheduler side: a prefix cache beyond the device's pool, in host memory
and optionally on disk, keyed by block hash.

What is stored: every full block of a request, once, in the step that computes it (the store
runs on the workers after that step's forward, before the block can be reused), so a block
that later leaves the pool (evicted, or freed by its finished request) is already in the
tier. With a disk tier, every stored block is written to disk too (write-through), so the disk
holds what the host tier evicts and what a restarted engine finds. A lookup continues a
request's local prefix hit block by block while the host or the disk tier holds the next hash;
the blocks found load asynchronously (the request waits in WAITING_FOR_REMOTE_KVS for one step),
a disk block through a host slot when one can be freed (it is then in the host tier too).

Only full-attention models (one KV cache group): see `make_kv_connector`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.common.block_hash import BlockHash
from core_engine.core.kv_cache.kv_cache_manager import KVCacheBlocks
from core_engine.core.kv_connector.tier_index import TierIndex, TierIndexIntegrityError
from core_engine.core.request import Request
from core_engine.proto import SchedulerOutput
from core_engine.proto.kv_transfer import (
    BlockLoad,
    BlockStore,
    KVConnectorOutput,
    OffloadingConnectorMetadata,
    RequestLoad,
)
from core_engine.proto.kv_transfer_params import KVTransferParams


@dataclass(slots=True)
class _TrackedRequest:
    """A request the connector follows from admission to its end: its block ids as the workers
    know them (from the scheduler outputs) and how many of its leading full blocks have been
    checked into the tiers."""

    request: Request
    block_ids: list[int]
    num_checked_blocks: int = 0
    load_failed: bool = False


@dataclass(slots=True)
class OffloadingStats:
    """Cumulative: tokens looked up in the tiers on admission and tokens found there (a
    request's first lookup only: not again after a preemption or a failed load), bytes and seconds of transfers (all ranks'
    bytes, rank 0's seconds)."""

    queries: int = 0
    hits: int = 0
    num_bytes_loaded: int = 0
    num_bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


class OffloadingConnector:
    """A `KVConnectorBase` over a host `TierIndex` (slot = the workers' host block) and an
    optional disk `TierIndex`.

    `bytes_per_block`: one block's KV bytes summed over the tensor-parallel ranks (for the
    tier sizes reported in stats).
    """

    def __init__(
        self, block_size: int, bytes_per_block: int, host: TierIndex, disk: TierIndex | None
    ) -> None:
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.host = host
        self.disk = disk
        self.stats = OffloadingStats()
        self._requests: dict[str, _TrackedRequest] = {}
        self._loads: list[RequestLoad] = []
        self._disk_deletes: dict[BlockHash, None] = {}  # an ordered set

    def describe(self) -> str:
        """The start-up log line: each tier's size in bytes and blocks."""

        def tier(name: str, index: TierIndex) -> str:
            num_bytes = index.capacity * self.bytes_per_block
            return f"{name} tier {num_bytes / 2**30:.2f} GiB = {index.capacity} blocks"

        tiers = [tier("host", self.host)]
        if self.disk is not None:
            tiers.append(tier("disk", self.disk))
        return (
            f"KV offloading (OffloadingConnector): {', '.join(tiers)} of {self.block_size} "
            "tokens, for prefix hits beyond the KV cache"
        )

    # ---- lookup and loads ------------------------------------------------------------------

    def _holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self.host or (self.disk is not None and block_hash in self.disk)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Whole blocks after the local hit that a tier holds, never the last token (its logits
        are needed); loaded asynchronously. A request whose load failed once gets none."""
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.load_failed:
            return 0, False
        first = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        num_blocks = 0
        for block_hash in request.block_hashes[first:end]:
            if not self._holds(block_hash):
                break
            num_blocks += 1
        return num_blocks * self.block_size, num_blocks > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Follows the request; plans the load of its `num_external_tokens`, which sit right
        after its local hit (its leading blocks that are in the prefix cache already)."""
        block_ids = blocks.get_block_ids()[0]
        if request.request_id not in self._requests:  # its first lookup: counted
            self._requests[request.request_id] = _TrackedRequest(request, block_ids)
            self.stats.queries += request.num_tokens
            self.stats.hits += num_external_tokens
        if num_external_tokens == 0:
            return
        first = sum(1 for block in blocks.blocks[0] if block.block_hash is not None)
        indices = range(first, first + num_external_tokens // self.block_size)
        for index in indices:  # first, so that promoting a disk block evicts none of these
            if request.block_hashes[index] in self.host:
                self.host.pin(request.block_hashes[index])
        loads = [self._plan_load(request.block_hashes[i], block_ids[i]) for i in indices]
        self._loads.append(RequestLoad(request.request_id, loads))

    def _plan_load(self, block_hash: BlockHash, block_id: int) -> BlockLoad:
        """From the host slot; else from disk, through a host slot when one can be freed."""
        host_slot = self.host.get_slot(block_hash)
        if host_slot is not None:
            self.host.touch(block_hash)
            self.host.pin(block_hash)
            return BlockLoad(block_id, host_slot)
        self.disk.touch(block_hash)
        self.disk.pin(block_hash)
        allocated = self.host.allocate(block_hash)
        if allocated is None:
            return BlockLoad(block_id, None, block_hash)
        self.host.pin(block_hash)
        return BlockLoad(block_id, allocated[0], block_hash)

    # ---- stores ----------------------------------------------------------------------------

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        """The planned loads, plus a store for every block this step fills that no tier holds."""
        stores: list[BlockStore] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new_req.req_id)
            if tracked is not None:
                tracked.block_ids = list(new_req.block_ids[0])
                num_computed = new_req.num_computed_tokens + num_scheduled[new_req.req_id]
                self._store_full_blocks(tracked, num_computed, stores)
        for cached_req in scheduler_output.scheduled_cached_reqs:
            tracked = self._requests.get(cached_req.req_id)
            if tracked is None:
                continue
            if cached_req.resumed_from_preemption:
                tracked.block_ids = list(cached_req.new_block_ids[0])
            elif cached_req.new_block_ids:
                tracked.block_ids.extend(cached_req.new_block_ids[0])
            num_computed = cached_req.num_computed_tokens + num_scheduled[cached_req.req_id]
            self._store_full_blocks(tracked, num_computed, stores)
        metadata = OffloadingConnectorMetadata(self._loads, stores, list(self._disk_deletes))
        self._loads = []
        self._disk_deletes = {}
        return metadata

    def _store_full_blocks(
        self, tracked: _TrackedRequest, num_computed_tokens: int, stores: list[BlockStore]
    ) -> None:
        """Checks the request's blocks full once `num_computed_tokens` are computed (scheduled
        drafts beyond its known tokens excluded: they have no hash) into the tiers."""
        request = tracked.request
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_full = min(num_full, len(tracked.block_ids))
        for index in range(tracked.num_checked_blocks, num_full):
            store = self._plan_store(request.block_hashes[index], tracked.block_ids[index])
            if store is not None:
                stores.append(store)
        tracked.num_checked_blocks = max(tracked.num_checked_blocks, num_full)

    def _plan_store(self, block_hash: BlockHash, block_id: int) -> BlockStore | None:
        """A store into every tier missing the hash (None when none is, or none has room)."""
        host_slot = None
        if block_hash in self.host:
            self.host.touch(block_hash)
        elif (allocated := self.host.allocate(block_hash)) is not None:
            host_slot = allocated[0]
            self.host.pin(block_hash)
        disk_hash = None
        if self.disk is not None:
            if block_hash in self.disk:
                self.disk.touch(block_hash)
            elif (allocated := self.disk.allocate(block_hash)) is not None:
                disk_hash = block_hash
                self.disk.pin(block_hash)
                self._disk_deletes.pop(block_hash, None)
                if allocated[1] is not None:
                    self._disk_deletes[allocated[1]] = None
        if host_slot is None and disk_hash is None:
            return None
        return BlockStore(block_id, host_slot, disk_hash)

    # ---- reports and ends ------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        """False: loads are planned for requests that wait (and so step), stores in steps."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The step's transfers are done: its pins go; bad hashes are forgotten; a request
        whose load failed is never offered external tokens again."""
        self.host.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
        for block_hash in output.invalid_block_hashes:
            self.host.remove(BlockHash(block_hash))
            if self.disk is not None:
                self.disk.remove(BlockHash(block_hash))
        for request_id in output.failed_recving:
            tracked = self._requests.get(request_id)
            if tracked is not None:
                tracked.load_failed = True
                tracked.num_checked_blocks = 0
        self.stats.num_bytes_loaded += output.num_bytes_loaded
        self.stats.num_bytes_stored += output.num_bytes_stored
        self.stats.load_s += output.load_s
        self.stats.store_s += output.store_s

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        """Nothing to hold: every block was stored in the step that computed it."""
        self._requests.pop(request.request_id, None)
        return False, None

    def stats_fields(self) -> dict[str, int | float]:
        stats = self.stats
        return {
            "external_prefix_cache_queries": stats.queries,
            "external_prefix_cache_hits": stats.hits,
            "kv_offload_host_bytes": len(self.host) * self.bytes_per_block,
            "kv_offload_disk_bytes": len(self.disk) * self.bytes_per_block if self.disk else 0,
            "kv_offload_loaded_bytes": stats.num_bytes_loaded,
            "kv_offload_stored_bytes": stats.num_bytes_stored,
            "kv_offload_load_s": stats.load_s,
            "kv_offload_store_s": stats.store_s,
        }

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        for block_hash in self._disk_deletes:
            if self.disk is not None and block_hash in self.disk:
                raise TierIndexIntegrityError(
                    f"hash {block_hash.hex()} is to be deleted from disk but still indexed"
                )
