"""`KVConnectorBase`: the scheduler side of a KV connector (vLLM's `KVConnectorBase_V1`, scheduler
role). The worker side is `worker.kv_connector.kv_connector_worker.KVConnectorWorker`.

A step, as the scheduler drives it:
1. For a waiting request it looks up its local prefix hit, then asks
   `get_num_new_matched_tokens(request, num_computed_tokens)` how many tokens after that hit
   the connector can provide, and whether they arrive asynchronously.
2. Once `allocate_slots` has given the request blocks for all of them,
   `update_state_after_alloc(request, blocks, num_external_tokens)` tells the connector where
   to put them. An asynchronous load makes the request wait in WAITING_FOR_REMOTE_KVS, holding
   its blocks (not yet in the prefix cache), until the workers report it in
   `KVConnectorOutput.finished_recving` (or `failed_recving`: its tokens are computed instead).
3. `build_connector_meta(scheduler_output)` returns this step's work for the workers, shipped
   as `SchedulerOutput.kv_connector_metadata`.
4. `update_connector_output(output)` takes rank 0's report of the step's transfers.
5. `request_finished(request, block_ids)` when a request ends: (True, params) keeps its blocks
   until the workers report it in `finished_sending`; `params` are its `kv_transfer_params`
   (what a peer needs to pull its KV; prefill/decode disaggregation).
"""

from __future__ import annotations

from typing import Protocol

from core_engine.core.kv_cache.kv_cache_manager import KVCacheBlocks
from core_engine.core.request import Request
from core_engine.proto import SchedulerOutput
from core_engine.proto.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from core_engine.proto.kv_transfer_params import KVTransferParams


class KVConnectorBase(Protocol):
    """The scheduler's view of a connector; lives in the engine core process (no torch)."""

    def describe(self) -> str:
        """One start-up log line: what the connector is, its tiers or roles, their sizes."""
        ...

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens after the first `num_computed_tokens` the connector can provide, whether
        they load asynchronously). Counts nothing and reserves nothing: the request may not
        get blocks this step and be asked again the next."""
        ...

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The request was admitted (or parked to load) holding `blocks` (all of its blocks),
        `num_external_tokens` of which the connector fills; called once per admission that
        looked the request up."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's work for the workers; resets the step's pending work."""
        ...

    def has_pending_work(self) -> bool:
        """Whether work not yet in a step's metadata must reach the workers even if no request
        runs (a step is then scheduled for it)."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of the step whose metadata was built last."""
        ...

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        """(whether to keep the blocks until `finished_sending` names the request, its
        kv_transfer_params for the client: where a decode instance pulls them from)."""
        ...

    def stats_fields(self) -> dict[str, int | float]:
        """The connector's `SchedulerStats` fields (cumulative counters and tier sizes)."""
        ...

    def check_integrity(self) -> None:
        """Raises if the connector's bookkeeping is unsound (called by the property tests)."""
        ...
