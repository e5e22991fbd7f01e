"""Messages on the frontend <-> engine core link.

Frontend -> core (ROUTER -> DEALER): `EngineCoreRequest`, `AbortRequests`, `UtilityRequest`.
Core -> frontend (PUSH -> PULL): `EngineReady` once, then `EngineCoreOutputs` per step and
`UtilityResponse` answers.
"""

from __future__ import annotations

import enum

import msgspec

from core_engine.proto.kv_transfer_params import KVTransferParams
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.proto.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped; `str()` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request sent in full once. Token ids only: the frontend tokenizes. `lora_request`:
    the adapter it runs with (None: the base model), already checked by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]


class UtilityMethod(enum.StrEnum):
    """What a `UtilityRequest` asks the core; a value outside these fails to decode."""

    GET_STATS = "get_stats"  # answered with the scheduler's stats
    RESET_PREFIX_CACHE = "reset_prefix_cache"  # an error while requests hold KV blocks
    PING = "ping"  # an empty answer: the core is alive and reading
    GET_KV_BLOCK_MAP = "get_kv_block_map"  # answered with the KV pool's `KVBlockMap`


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call into the core that answers with one `UtilityResponse` carrying the same call_id."""

    call_id: int
    method: UtilityMethod


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprob of one sampled token plus the top-N alternatives (N = SamplingParams.logprobs)."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What happened to one request in one step.

    `finish_reason is None` while the request runs. `error` is set with
    `FinishReason.ERROR` (rejected prompt, dead worker) and says what went wrong.
    `prompt_logprobs` (asked by `SamplingParams.prompt_logprobs`) come once, with the first
    token: entry i is prompt token i + 1's logprob given the tokens before it.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    queue_time_s: float = 0.0  # with the first token: how long the request waited to run
    # With the final output of a request a prefill instance holds KV for: where to pull it.
    kv_transfer_params: KVTransferParams | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# The counters of SchedulerStats that only grow (the others are gauges of the moment).
CUMULATIVE_STATS = (
    "num_steps",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_requests",
    "prefix_cache_preempted_requests",
    "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits",
    "num_prompt_tokens",
    "num_generation_tokens",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "kv_offload_loaded_bytes",
    "kv_offload_stored_bytes",
    "kv_offload_load_s",
    "kv_offload_store_s",
)


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """A snapshot of the scheduler; prefix cache counters are cumulative, in tokens (requests
    in requests), one lookup per admitted request; `prefix_cache_preempted_*` count the lookups
    of requests readmitted after a preemption, which the others (and the hit rate) leave out.
    `spec_decode_*` count speculative decoding, cumulatively: request-steps that verified
    drafts, their draft tokens, the tokens accepted, and per draft position (0-based) how many
    drafts had their token there accepted (one entry per speculative token; empty when
    speculation is off). Built on request (the `get_stats` utility call, which /metrics and
    the stats log poll), never per step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_preempted_requests: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # The KV connector's (zero without one): tokens looked up beyond the pool and found there
    # (a request's first lookup only), bytes its offloading tiers hold, bytes moved and the
    # seconds the transfers took (cumulative).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_host_bytes: int = 0
    kv_offload_disk_bytes: int = 0
    kv_offload_loaded_bytes: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_load_s: float = 0.0
    kv_offload_store_s: float = 0.0
    # With enable_lora: the names of the adapters of running and of waiting requests (vLLM's
    # lora_requests_info gauge), each name once.
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)

    def increase_since(self, before: SchedulerStats) -> SchedulerStats:
        """What happened between `before` and this snapshot: these gauges, with every
        cumulative counter (`CUMULATIVE_STATS`, and the accepted drafts per position) reduced
        to its increase."""
        increases = {name: getattr(self, name) - getattr(before, name) for name in CUMULATIVE_STATS}
        before_per_pos = before.spec_decode_num_accepted_tokens_per_pos
        increases["spec_decode_num_accepted_tokens_per_pos"] = [
            after - earlier
            for after, earlier in zip(
                self.spec_decode_num_accepted_tokens_per_pos, before_per_pos, strict=True
            )
        ]
        return msgspec.structs.replace(self, **increases)

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Draft tokens accepted per draft token verified (0 before any draft)."""
        if self.spec_decode_num_draft_tokens == 0:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verifying request gains per step: 1 (the token sampled after the accepted
        drafts) plus the accepted drafts, on average (0 before any draft)."""
        if self.spec_decode_num_drafts == 0:
            return 0.0
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts


class KVBlockState(enum.IntEnum):
    """What one KV block (or one cell of a summarised map) holds, least to most busy."""

    FREE = 0  # in the free queue, no valid prefix-cache content
    CACHED = 1  # in the free queue, still holding a prefix-cache hit (evicted on reuse)
    IN_USE = 2  # held by exactly one request
    SHARED = 3  # held by several requests (a shared prefix)
    RESERVED = 4  # the null block, never handed out


MAX_KV_BLOCK_MAP_CELLS = 4096


class KVBlockMap(msgspec.Struct, array_like=True, gc=False):
    """The state of every block of a core's KV pool, for a picture of it.

    `states` holds one `KVBlockState` byte per cell; cell i covers blocks
    `[i * blocks_per_cell, (i + 1) * blocks_per_cell)` (the last one fewer) and shows the busiest
    state among them, so a pool over `MAX_KV_BLOCK_MAP_CELLS` blocks is summarised without
    hiding where requests sit. `num_blocks_by_state[s]` counts the blocks (not cells) in state s.
    """

    num_blocks: int
    blocks_per_cell: int
    states: bytes
    num_blocks_by_state: list[int]


class KVCacheEvents(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How a core's prefix cache changed since its last report (sent only with data
    parallelism): `cleared` (every hash forgotten) first, then `removed`, then `stored`. Hashes
    are `common.block_hash.compact_block_hash` of the first KV cache group's block hashes."""

    stored: list[int] = msgspec.field(default_factory=list)
    removed: list[int] = msgspec.field(default_factory=list)
    cleared: bool = False


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    timestamp: float = 0.0
    kv_events: KVCacheEvents | None = None


class EngineReady(msgspec.Struct, array_like=True, gc=False):
    """The core's first message: what the engine can hold, its step token budget, the
    model's vocabulary size and eos ids (from the workers' `WorkerReady`), and the scheduling
    policy (a frontend attached to a core started separately learns it here)."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    policy: str = "fcfs"
    # With enable_lora: the shapes an adapter must have (rank 0's report); None otherwise.
    lora_target_shapes: LoRATargetShapes | None = None


class UtilityResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    stats: SchedulerStats | None = None
    error: str | None = None
    kv_block_map: KVBlockMap | None = None


class EngineDead(msgspec.Struct, array_like=True, gc=False):
    """Sent by a dying core (e.g. a worker died) so clients fail fast instead of timing out.
    `is_config_error`: the engine could not start with its settings (`common.config_error`);
    `reason` names the setting."""

    reason: str
    is_config_error: bool = False
