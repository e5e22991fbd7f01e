"""`ExternalKVRequests`: the scheduler's requests whose KV is moving between the pool and a KV
connector: those waiting for their blocks to load (WAITING_FOR_REMOTE_KVS) and finished ones
whose blocks the connector still reads.

A request whose blocks have loaded gives them back to the pool as prefix-cache blocks and
rejoins the waiting queue with nothing computed: its next admission finds them as an ordinary
prefix hit. So no waiting request ever holds blocks, and one that cannot be admitted cannot
starve the requests before it of blocks (with prefix caching off there is no prefix cache to
keep them in, so `EngineConfig` refuses the offloading connector then).
"""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.core.request import Request, RequestStatus
from core_engine.proto.kv_transfer import KVConnectorOutput


@dataclass(slots=True)
class _Loading:
    request: Request
    status_after: RequestStatus  # WAITING, or PREEMPTED for a request resumed after preemption
    num_computed_tokens: int  # its local hit plus the tokens loading: what to cache


class ExternalKVRequests:
    """Invariants: a loading request holds its blocks, is in WAITING_FOR_REMOTE_KVS and in no
    queue; its loaded blocks enter the prefix cache only once the workers report them."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._loading: dict[str, _Loading] = {}
        self._loaded: set[str] = set()  # back in the queue after a load, not admitted yet
        self._held_for_sending: dict[str, Request] = {}

    def __len__(self) -> int:
        """Requests waiting for their KV (finished ones held for sending are not counted)."""
        return len(self._loading)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._loading

    def park(self, request: Request, num_computed_tokens: int) -> None:
        """The request waits for its blocks; once they load, its first `num_computed_tokens`
        (its local hit and the loaded tokens) are cached."""
        status_after = (
            RequestStatus.PREEMPTED
            if request.status == RequestStatus.PREEMPTED
            else RequestStatus.WAITING
        )
        self._loading[request.request_id] = _Loading(request, status_after, num_computed_tokens)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def remove(self, request_id: str) -> None:
        """Forgets an aborted request (its blocks are freed by the caller)."""
        self._loading.pop(request_id, None)
        self._loaded.discard(request_id)

    def take_loaded(self, request_id: str) -> bool:
        """Whether the request is being admitted right after its load (its lookup was counted
        when the load started); true once."""
        if request_id in self._loaded:
            self._loaded.remove(request_id)
            return True
        return False

    def finish_loads(self, output: KVConnectorOutput) -> list[Request]:
        """The requests the workers report loaded (their blocks now cached, and freed) or
        failed to load (their blocks freed uncached), holding nothing, in their status before
        the wait: for the waiting queue, where their next lookup finds what loaded."""
        ready = []
        for request_id in output.finished_recving:
            loading = self._loading.pop(request_id, None)
            if loading is None:
                continue  # aborted while loading
            self.kv_cache_manager.cache_blocks(loading.request, loading.num_computed_tokens)
            self._loaded.add(request_id)
            ready.append(self._release(loading))
        for request_id in output.failed_recving:
            loading = self._loading.pop(request_id, None)
            if loading is not None:
                self._loaded.add(request_id)
                ready.append(self._release(loading))
        return ready

    def _release(self, loading: _Loading) -> Request:
        self.kv_cache_manager.free(loading.request)
        loading.request.status = loading.status_after
        return loading.request

    @property
    def num_held_for_sending(self) -> int:
        return len(self._held_for_sending)

    def hold_for_sending(self, request: Request) -> None:
        """A finished request whose blocks the connector reads until `finished_sending`."""
        self._held_for_sending[request.request_id] = request

    def release_sent(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self._held_for_sending.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
