"""Messages on the engine core <-> worker link.

Core -> workers (broadcast): `InitKVCache` once, then `SchedulerOutput` per step, `Shutdown`.
Workers -> core: `WorkerReady` once (after model load and memory profiling), then rank 0's
`ModelRunnerOutput` per step, or `WorkerError`.

A worker on another host opens the link itself: it connects to the core's worker address and
sends `WorkerHello`; the core answers `WorkerWelcome` (the engine's config and the
torch.distributed rendezvous) or `WorkerRejected` and a close. From then on the link is the same.
"""

from __future__ import annotations

import msgspec

from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.engine_messages import TokenLogprobs
from core_engine.proto.kv_transfer import (
    KVConnectorHandshake,
    KVConnectorMetadata,
    KVConnectorOutput,
)
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.proto.sampling_params import SamplingParams, StructuredOutputs

WORKER_PROTOCOL_VERSION = 6
"""Raised whenever a message of this link changes shape (EngineConfig included): a worker on
another host runs its own copy of the engine, and the core admits only its own version."""


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen: sent in full exactly once. `block_ids[g]` are its
    blocks in KV cache group g (see common.kv_cache_groups; one group for most models).
    `lora_request`: the adapter its tokens go through (None: the base model)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A delta for a request the workers already hold.

    `new_token_ids`: tokens appended to the request since the workers last saw it (the ones
    sampled last step), so every rank has the same token history without sampling itself.
    `new_block_ids[g]`: appended to the request's block list in KV cache group g, or when
    `resumed_from_preemption` the group's whole new block list (its old blocks were freed at
    preemption); empty (no list at all) when no group has new blocks, as in most decode steps.
    """

    req_id: str
    num_computed_tokens: int
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    resumed_from_preemption: bool = False


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's plan. Requests run in the order new-then-cached as listed here.

    Invariant: `total_num_scheduled_tokens == sum(num_scheduled_tokens.values())`, and each key
    of `num_scheduled_tokens` names exactly one entry of `scheduled_new_reqs` or
    `scheduled_cached_reqs`. Requests held by a worker but absent from this step (preempted, or
    simply not scheduled) stay cached on the worker until listed in `finished_req_ids`.

    `grammars_to_prepare`: the output constraints of requests that arrived since the last step,
    by request id, sent once each: every rank starts compiling them at once, without waiting.
    Such a request is scheduled only after rank 0 reports its grammar in
    `ModelRunnerOutput.grammars_ready` (a step with no tokens but grammars still compiling is
    answered when one finishes, or after a short wait, so an idle core does not spin).

    `scheduled_spec_decode_tokens[req_id]`: draft tokens to verify (speculative decoding). Such a
    request is scheduled for `1 + len(drafts)` tokens: its last sampled token followed by the
    drafts, so the forward computes K+1 positions and the worker samples at every one of them
    (see `ModelRunnerOutput`). A request with no drafts this step is absent.

    `kv_connector_metadata`: this step's work for the KV connector's worker side (None without
    a connector; see `proto.kv_transfer`).
    """

    scheduled_new_reqs: list[NewRequestData] = msgspec.field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = msgspec.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    grammars_to_prepare: dict[str, StructuredOutputs] = msgspec.field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampled tokens, one list per request that finished its prompt this step.

    `req_ids[i]` got `sampled_token_ids[i]`; a request still in the middle of a chunked prefill
    gets an empty list (its sample is discarded). A request verifying K drafts gets 1..K+1
    tokens: the accepted drafts, in order, then one token sampled where the first rejected
    draft stood (or the bonus token after K accepted ones). `logprobs[i]` is set iff the
    request asked: one entry per token of `sampled_token_ids[i]`.
    `request_errors` names requests the worker cannot serve (e.g. a grammar that does not
    compile) with the reason; the scheduler finishes them with an error, the engine goes on.
    `grammars_ready` names requests of `SchedulerOutput.grammars_to_prepare` whose grammar has
    compiled since the last report (each reported once; a failed compile is a request error).
    `prompt_logprobs[req_id]` are the logprobs of the prompt tokens this step's chunk predicts,
    in order, for requests that asked for them.
    `kv_connector_output`: the KV connector's transfers of this step (None without one).
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    sampled_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] | None = None
    request_errors: dict[str, str] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    grammars_ready: list[str] = msgspec.field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None


class WorkerReady(msgspec.Struct, array_like=True, gc=False):
    """A worker loaded its model and measured how many KV blocks fit on its device; the limits
    it was built for (block_size, max_num_seqs, max_model_len, max_num_batched_tokens) bound the
    scheduler's. `vocab_size` and `eos_token_ids` are the model's, the one source every other
    process reads them from (through `EngineReady`)."""

    rank: int
    num_gpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    device: str
    vocab_size: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: list[int]
    # Per layer, its attention window (None: full attention); empty: no layers to speak of
    # (the null model), one full-attention group. The core groups the layers from this with
    # common.kv_cache_groups.group_layers, as the worker does to lay out its cache.
    layer_sliding_windows: list[int | None] = msgspec.field(default_factory=list)
    # The KV connector's side on this rank (None without a connector).
    kv_connector_handshake: KVConnectorHandshake | None = None
    # With enable_lora: the shapes an adapter of this model must have (unsharded).
    lora_target_shapes: LoRATargetShapes | None = None


class InitKVCache(msgspec.Struct, array_like=True, gc=False):
    """Allocate exactly this many KV blocks (the minimum over ranks, or the override)."""

    num_gpu_blocks: int


class KVCacheReady(msgspec.Struct, array_like=True, gc=False):
    rank: int


class Shutdown(msgspec.Struct, array_like=True, gc=False):
    pass


class WorkerError(msgspec.Struct, array_like=True, gc=False):
    """A worker failed; `is_config_error`: with a `common.config_error.ConfigError`, whose
    `message` names the setting (no traceback is worth showing)."""

    rank: int
    message: str
    is_config_error: bool = False


class WorkerHello(msgspec.Struct, array_like=True, gc=False):
    """A worker on another host, first thing after connecting: the rank it wants to be."""

    rank: int
    world_size: int
    protocol_version: int


class WorkerWelcome(msgspec.Struct, array_like=True, gc=False):
    """The core took a `WorkerHello`: what to build, and where the ranks meet for
    torch.distributed (`tcp://HOST:PORT`, rank 0's host)."""

    config: EngineConfig
    dist_init_address: str


class WorkerRejected(msgspec.Struct, array_like=True, gc=False):
    """The core refused a `WorkerHello`; it closes the connection right after."""

    reason: str
