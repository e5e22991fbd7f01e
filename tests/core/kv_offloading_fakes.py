"""A scheduler with the OffloadingConnector, and a fake worker side that moves block *labels*
(the hash a block's KV was computed for) instead of bytes: a loaded block must hold the label of
the hash the scheduler asked for, or the scheduler's slot bookkeeping is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_engine.core.kv_connector.offloading_connector import OffloadingConnector
from core_engine.core.kv_connector.tier_index import TierIndex
from core_engine.core.sched.scheduler import Scheduler
from core_engine.proto import SchedulerOutput
from core_engine.proto.kv_transfer import KVConnectorOutput, OffloadingConnectorMetadata
from tests.helpers.core_factories import BLOCK_SIZE, fake_model_output, make_scheduler

BYTES_PER_BLOCK = 1000


def make_offloading_scheduler(
    num_host_blocks: int, num_disk_blocks: int | None = None, **overrides
) -> Scheduler:
    host = TierIndex(num_host_blocks)
    disk = TierIndex(num_disk_blocks) if num_disk_blocks is not None else None
    connector = OffloadingConnector(BLOCK_SIZE, BYTES_PER_BLOCK, host, disk)
    config = dict(num_gpu_blocks=9, max_model_len=32)
    config.update(overrides)
    scheduler = make_scheduler(**config)
    scheduler.connector = connector
    return scheduler


@dataclass
class FakeTiers:
    """Device blocks, host slots and disk files, each holding a block label (its hash)."""

    device: dict[int, bytes] = field(default_factory=dict)
    host: dict[int, bytes] = field(default_factory=dict)
    disk: dict[bytes, bytes] = field(default_factory=dict)
    bad_disk_hashes: set[bytes] = field(default_factory=set)

    def compute(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
        """What the forward writes: the blocks each scheduled request fills this step (from
        the one holding its first scheduled token on), never the ones it found computed."""
        num_computed_before = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        for cached in scheduler_output.scheduled_cached_reqs:
            num_computed_before[cached.req_id] = cached.num_computed_tokens
        for request_id, num_before in num_computed_before.items():
            request = scheduler.requests[request_id]
            block_ids = scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            num_full = min(request.num_computed_tokens // BLOCK_SIZE, len(request.block_hashes))
            for index in range(num_before // BLOCK_SIZE, num_full):
                self.device[block_ids[index]] = request.block_hashes[index]

    def check_running_blocks(self, scheduler: Scheduler) -> None:
        """Every full block a running request has computed holds its own hash's KV."""
        for request in scheduler.running:
            block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
            num_full = min(request.num_computed_tokens // BLOCK_SIZE, len(request.block_hashes))
            for index in range(num_full):
                label = self.device.get(block_ids[index])
                assert label == request.block_hashes[index], (
                    f"{request.request_id} block {index} (id {block_ids[index]}) holds the KV "
                    "of another block"
                )

    def transfer(self, metadata: OffloadingConnectorMetadata) -> KVConnectorOutput:
        output = KVConnectorOutput()
        for load in metadata.loads:
            failed = False
            for block in load.blocks:
                if block.disk_hash is None:
                    self.device[block.block_id] = self.host[block.host_slot]
                elif block.disk_hash in self.bad_disk_hashes or block.disk_hash not in self.disk:
                    output.invalid_block_hashes.append(block.disk_hash)
                    failed = True
                else:
                    label = self.disk[block.disk_hash]
                    self.device[block.block_id] = label
                    if block.host_slot is not None:
                        self.host[block.host_slot] = label
            (output.failed_recving if failed else output.finished_recving).append(load.req_id)
        for store in metadata.stores:
            if store.host_slot is not None:
                self.host[store.host_slot] = self.device[store.block_id]
            if store.disk_hash is not None:
                self.disk[store.disk_hash] = self.device[store.block_id]
        for block_hash in metadata.disk_deletes:
            self.disk.pop(block_hash, None)
        return output


def step(scheduler: Scheduler, tiers: FakeTiers) -> SchedulerOutput:
    """One step through the fake forward and the fake transfers; checks every invariant."""
    scheduler_output = scheduler.schedule()
    tiers.compute(scheduler, scheduler_output)
    model_output = fake_model_output(scheduler, scheduler_output)
    model_output.kv_connector_output = tiers.transfer(scheduler_output.kv_connector_metadata)
    scheduler.update_from_output(scheduler_output, model_output)
    scheduler.kv_cache_manager.check_integrity()
    scheduler.connector.check_integrity()
    tiers.check_running_blocks(scheduler)
    return scheduler_output
