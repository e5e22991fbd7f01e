"""`TcpConnector`, scheduler side: prefill/decode disaggregation (vLLM's P/D connectors' flow,
over a plain TCP pull; the worker side is `worker.kv_connector.tcp_connector_worker`).

Producer (`kv_producer`, prefill instance): a request with `do_remote_decode` that finishes
(stop or length: max_tokens 1) keeps its blocks: `request_finished` returns hold=True and the
`KVTransferParams` a decode instance needs; the prompt's full blocks are served by the worker's
block server until the consumer releases them or `send_timeout_s` passes, then the workers
report the request in `finished_sending` and its blocks are freed.

Consumer (`kv_consumer`, decode instance): a request with `do_remote_prefill` gets the leading
remote blocks whose transfer hash equals its own (never the block of its last prompt token: its
logits are needed) as external tokens, loaded asynchronously: it waits in WAITING_FOR_REMOTE_KVS
while the worker pulls them, then joins the prefix cache and is admitted as a prefix hit. Its
params are used once: after a pull (done or failed) it gets no external tokens, so a failed pull
means the prompt is computed here. A request that needs none of the blocks (a local prefix hit
covers them, it asks for prompt logprobs, or it ended first) only releases them.

`kv_both` does both. Only one KV cache group and tensor_parallel_size 1 (`make_kv_connector`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core_engine.common.block_hash import transfer_block_hashes
from core_engine.core.kv_cache.kv_cache_manager import KVCacheBlocks
from core_engine.core.request import Request, RequestStatus
from core_engine.proto import SchedulerOutput
from core_engine.proto.kv_transfer import (
    KVConnectorHandshake,
    KVConnectorOutput,
    KVTransferConfig,
    RequestPull,
    RequestSend,
    TcpConnectorMetadata,
)
from core_engine.proto.kv_transfer_params import KVTransferParams


class TcpConnectorIntegrityError(RuntimeError):
    """The connector's bookkeeping is unsound: a bug, never a user error."""


@dataclass(slots=True)
class TransferStats:
    """Cumulative: prompt tokens of requests that came with remote KV and the tokens pulled
    for them (vLLM's external prefix cache counters); bytes and seconds of pulls."""

    queries: int = 0
    hits: int = 0
    num_bytes_loaded: int = 0
    load_s: float = 0.0


@dataclass(slots=True)
class _PendingWork:
    sends: list[RequestSend] = field(default_factory=list)
    pulls: list[RequestPull] = field(default_factory=list)


class TcpConnector:
    """A `KVConnectorBase`. `handshake`: the worker's (its block server's address and the
    engine id it serves under)."""

    def __init__(
        self, transfer: KVTransferConfig, block_size: int, handshake: KVConnectorHandshake
    ) -> None:
        self.block_size = block_size
        self.is_producer = transfer.is_kv_producer
        self.is_consumer = transfer.is_kv_consumer
        self.handshake = handshake
        self.stats = TransferStats()
        self._pending = _PendingWork()
        self._used: set[str] = set()  # consumer requests whose remote params were used
        self._num_matching_blocks: dict[str, int] = {}

    def describe(self) -> str:
        """The start-up log line: the roles it plays and where its block server listens."""
        roles = [
            role
            for role, plays in (
                (
                    f"serves KV on {self.handshake.transfer_host}:{self.handshake.transfer_port}",
                    self.is_producer,
                ),
                ("pulls prefills' KV from producers", self.is_consumer),
            )
            if plays
        ]
        return (
            f"KV transfer (TcpConnector): {' and '.join(roles)}, blocks of {self.block_size} tokens"
        )

    # ---- consumer: lookups and pulls -------------------------------------------------------

    def _remote_prefill(self, request: Request) -> KVTransferParams | None:
        """The request's params if it has remote KV this consumer has not used yet."""
        params = request.sampling_params.kv_transfer_params
        if not self.is_consumer or params is None or not params.do_remote_prefill:
            return None
        return None if request.request_id in self._used else params

    def _matching_blocks(self, request: Request, params: KVTransferParams) -> int:
        """Leading remote blocks holding this prompt's tokens, last prompt token excluded."""
        num_blocks = self._num_matching_blocks.get(request.request_id)
        if num_blocks is None:
            limit = (request.num_prompt_tokens - 1) // self.block_size
            own = transfer_block_hashes(
                request.prompt_token_ids[: limit * self.block_size],
                self.block_size,
                request.sampling_params.cache_salt,
            )
            num_blocks = 0
            for mine, theirs in zip(own, params.block_hashes, strict=False):
                if mine != theirs:
                    break
                num_blocks += 1
            self._num_matching_blocks[request.request_id] = num_blocks
        return num_blocks

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._remote_prefill(request)
        if params is None:
            return 0, False
        first = num_computed_tokens // self.block_size
        num_blocks = self._matching_blocks(request, params) - first
        if num_blocks <= 0:
            return 0, False
        return num_blocks * self.block_size, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plans the pull of the `num_external_tokens` after the local hit (or only the
        release, when there are none); the params are used up either way."""
        params = self._remote_prefill(request)
        if params is None:
            return
        self._used.add(request.request_id)
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += num_external_tokens
        first = sum(1 for block in blocks.blocks[0] if block.block_hash is not None)
        indices = range(first, first + num_external_tokens // self.block_size)
        local_block_ids = blocks.get_block_ids()[0]
        self._pending.pulls.append(
            RequestPull(
                req_id=request.request_id,
                host=params.remote_host,
                port=params.remote_port,
                engine_id=params.remote_engine_id,
                remote_request_id=params.remote_request_id,
                remote_block_ids=[params.remote_block_ids[i] for i in indices],
                local_block_ids=[local_block_ids[i] for i in indices],
                block_hashes=[params.block_hashes[i] for i in indices],
            )
        )

    def _release_unused(self, request: Request) -> None:
        """A request that ends before using its remote KV still frees the producer's blocks."""
        params = self._remote_prefill(request)
        if params is not None:
            self._pending.pulls.append(
                RequestPull(
                    request.request_id,
                    params.remote_host,
                    params.remote_port,
                    params.remote_engine_id,
                    params.remote_request_id,
                    [],
                    [],
                    [],
                )
            )

    # ---- both: the step's metadata and the workers' report ---------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TcpConnectorMetadata:
        pending, self._pending = self._pending, _PendingWork()
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return TcpConnectorMetadata(pending.sends, pending.pulls, idle)

    def has_pending_work(self) -> bool:
        """Holds to register and releases to send: the producer's blocks wait on them."""
        return bool(self._pending.sends or self._pending.pulls)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.stats.num_bytes_loaded += output.num_bytes_loaded
        self.stats.load_s += output.load_s

    # ---- producer: holding a finished prompt's blocks --------------------------------------

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        """Producer: (True, where to pull) for a `do_remote_decode` request that finished
        normally with at least one full prompt block; else (False, None)."""
        self._release_unused(request)
        self._used.discard(request.request_id)
        self._num_matching_blocks.pop(request.request_id, None)
        params = request.sampling_params.kv_transfer_params
        finished_normally = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        if not (self.is_producer and params is not None and params.do_remote_decode):
            return False, None
        num_blocks = min(request.num_prompt_tokens // self.block_size, len(block_ids[0]))
        if not finished_normally or num_blocks == 0:
            return False, None
        held_ids = list(block_ids[0][:num_blocks])
        hashes = transfer_block_hashes(
            request.prompt_token_ids[: num_blocks * self.block_size],
            self.block_size,
            request.sampling_params.cache_salt,
        )
        self._pending.sends.append(RequestSend(request.request_id, held_ids, list(hashes)))
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.handshake.engine_id,
            remote_host=self.handshake.transfer_host,
            remote_port=self.handshake.transfer_port,
            remote_request_id=request.request_id,
            remote_block_ids=held_ids,
            remote_block_hashes=[h.hex() for h in hashes],
        )

    def stats_fields(self) -> dict[str, int | float]:
        return {
            "external_prefix_cache_queries": self.stats.queries,
            "external_prefix_cache_hits": self.stats.hits,
            "kv_offload_loaded_bytes": self.stats.num_bytes_loaded,
            "kv_offload_load_s": self.stats.load_s,
        }

    def check_integrity(self) -> None:
        for pull in self._pending.pulls:
            if len(pull.remote_block_ids) != len(pull.local_block_ids):
                raise TcpConnectorIntegrityError(
                    f"pull of {pull.req_id} pairs {len(pull.remote_block_ids)} remote blocks "
                    f"with {len(pull.local_block_ids)} local ones"
                )
        for send in self._pending.sends:
            if len(send.block_ids) != len(send.block_hashes):
                raise TcpConnectorIntegrityError(f"send of {send.req_id} lacks block hashes")
