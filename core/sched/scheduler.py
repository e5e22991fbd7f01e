"""Continuous-batching scheduler (vLLM V1 semantics): one token budget per step, no phases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core_engine.core.kv_cache.kv_cache_events import KVCacheEventLog
from core_engine.core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_connector.external_kv_requests import ExternalKVRequests
from core_engine.core.kv_connector.kv_connector_base import KVConnectorBase
from core_engine.core.request import Request, RequestStatus
from core_engine.core.sched.request_queue import create_request_queue
from core_engine.core.sched.scheduler_config import (
    SchedulerConfig,
    blocks_per_full_length_request,
    check_pool_holds_one_request,
)
from core_engine.core.sched.stop_checks import append_until_stop
from core_engine.core.spec_decode.draft_verification import (
    roll_back_rejected_drafts,
)
from core_engine.core.spec_decode.drafter import Drafter
from core_engine.core.spec_decode.spec_decoding_stats import SpecDecodingStats
from core_engine.proto import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from core_engine.proto.kv_transfer import KVConnectorOutput
from core_engine.proto.kv_transfer_params import KVTransferParams
from core_engine.proto.sampling_params import StructuredOutputs

__all__ = ["Scheduler", "SchedulerConfig"]


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call decided, before it is turned into a SchedulerOutput."""

    token_budget: int
    new_reqs: list[Request]
    resumed_reqs: list[Request]
    running_reqs: list[Request]
    preempted_reqs: list[Request]
    num_scheduled_tokens: dict[str, int]
    req_to_new_blocks: dict[str, KVCacheBlocks]
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    """Decides each step which requests run and on how many tokens.

    Each request has `num_computed_tokens` and `num_tokens`; a step hands out tokens from
    `max_num_batched_tokens`, running requests first (in order), then waiting ones (up to
    `max_num_seqs` running). Prompts are chunked by the budget and by
    `long_prefill_token_threshold` (never, with `enable_chunked_prefill` off). When KV blocks
    run out, the last running request (FCFS) or the lowest-priority one is preempted by
    recompute, and no waiting request is admitted in that step. `num_computed_tokens` is
    advanced when a step is scheduled.

    A constrained request is not scheduled, and holds no blocks, until the workers report its
    grammar compiled (WAITING_FOR_FSM, see `add_request`): a slow compile stalls only its own
    request, and a failed one finishes it with an error.

    `kv_cache_config` gives the KV cache groups of a hybrid model (one full-attention group
    otherwise); the workers get every group's block ids.

    Speculative decoding (`config.speculative_config`): before each step the `Drafter` gives
    decoding requests draft tokens; the budget and the KV slots count them (a request with K
    drafts is scheduled for 1 + K tokens), but drafts are cut, never another request
    preempted, when the budget or the free blocks cannot hold them. After the step the
    rejected drafts are rolled back from `num_computed_tokens` and the accepted tokens
    appended one by one through the stop checks. Drafts never enter `all_token_ids`, so only
    accepted tokens' blocks are hashed into the prefix cache. Drafts are part of
    `num_new_tokens` in `allocate_slots` (tokens computed this step); `num_lookahead_tokens`
    stays 0: it reserves slots for tokens a proposer in the worker would write after the step
    (EAGLE), and drafts proposed here need none beyond their own.

    Async scheduling (`config.async_scheduling`): `schedule()` may run again before the last
    step's output is back. A request that samples in a step gets an output placeholder
    (`Request.num_output_placeholders`) until `update_from_output` brings the token, and the
    next step already computes it: the workers append the tokens they sample themselves, so
    they are never sent back. A request whose pending tokens reach `max_tokens` or
    `max_model_len` is not scheduled again; one that stops early (eos, a stop token) may have
    one step scheduled past its end, whose token is dropped (its KV went into a slot past the
    request's tokens, in a block that was never hashed, so no prefix hit can read it).

    `connector` (see `core.kv_connector.kv_connector_base`) extends a waiting request's prefix
    hit with tokens from beyond the pool; while they load the request waits in
    WAITING_FOR_REMOTE_KVS (`external_kv`), and the other requests keep stepping.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_config: KVCacheConfig | None = None,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        if kv_cache_config is None:
            kv_cache_config = KVCacheConfig.full_attention(config.block_size, config.max_model_len)
        check_pool_holds_one_request(config, kv_cache_config)
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            kv_cache_config=kv_cache_config,
        )
        self.connector = connector
        self.external_kv = ExternalKVRequests(self.kv_cache_manager)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Constrained requests whose grammar the workers are compiling (WAITING_FOR_FSM), outside
        # `waiting` so the waiting pass never sees them; the ids whose constraint is not sent yet.
        self.waiting_for_fsm: dict[str, Request] = {}
        self._grammars_to_send: list[str] = []
        self._num_tokens_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        spec_config = config.speculative_config
        self.drafter = Drafter(spec_config, config.max_model_len) if spec_config else None
        self.spec_decoding_stats = SpecDecodingStats(
            spec_config.num_lookahead_tokens if spec_config else 0
        )

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError, leaving the scheduler untouched, for an id
        already in use or another block size than the engine's; whether the request fits the
        model (its prompt, `max_tokens`) is checked where requests are built
        (`proto.request_fit`).

        A request with an output constraint waits in `waiting_for_fsm` (WAITING_FOR_FSM) while
        the workers compile its grammar, and joins `waiting` when rank 0 reports it ready."""
        problem = self._find_rejection(request)
        if problem is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            raise ValueError(problem)
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is not None:
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm[request.request_id] = request
            self._grammars_to_send.append(request.request_id)
        else:
            self.waiting.add_request(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def _find_rejection(self, request: Request) -> str | None:
        if request.request_id in self.requests:
            return f"request id {request.request_id!r} is already in use"
        if request.block_size != self.config.block_size:
            return f"request block_size {request.block_size} != engine block_size {self.config.block_size}"
        return None

    def finish_requests(self, request_ids: str | list[str], finished_status: RequestStatus) -> None:
        """Finishes (e.g. aborts) requests wherever they are; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        to_finish = [self.requests[rid] for rid in request_ids if rid in self.requests]
        running = [r for r in to_finish if r.status == RequestStatus.RUNNING]
        if running:
            running_ids = {id(r) for r in running}
            self.running = [r for r in self.running if id(r) not in running_ids]
        for request in to_finish:
            self.waiting_for_fsm.pop(request.request_id, None)
            self.external_kv.remove(request.request_id)
        queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.waiting.remove_requests(r for r in to_finish if r.status in queued)
        for request in to_finish:
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> KVTransferParams | None:
        """Frees (or holds, for the KV connector to send) the request's blocks; returns the
        connector's kv_transfer_params for the request's final output."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        hold, params = False, None
        if self.connector is not None:
            hold, params = self.connector.request_finished(request, block_ids)
        if hold:
            self.external_kv.hold_for_sending(request)
        else:
            self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        if self.drafter is not None:
            self.drafter.remove_request(request)
        self.finished_req_ids.add(request.request_id)
        self._num_tokens_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        return params

    def _take_grammars_to_prepare(self) -> dict[str, StructuredOutputs]:
        """The constraints of WAITING_FOR_FSM requests not yet sent to the workers (each is sent
        once; one finished before it was sent is skipped)."""
        grammars = {
            request_id: self.waiting_for_fsm[request_id].sampling_params.structured_outputs
            for request_id in self._grammars_to_send
            if request_id in self.waiting_for_fsm
        }
        self._grammars_to_send.clear()
        return grammars

    def _admit_ready_grammars(self, request_ids: list[str]) -> None:
        """Moves requests whose grammar rank 0 reports compiled to the waiting queue, at the
        place their arrival gives them; ids that finished meanwhile (or are unknown) are
        ignored."""
        for request_id in request_ids:
            request = self.waiting_for_fsm.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.WAITING
                self.waiting.add_request_in_arrival_order(request)

    def get_num_unfinished_requests(self) -> int:
        num_waiting = len(self.waiting) + len(self.waiting_for_fsm) + len(self.external_kv)
        return num_waiting + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_kv_transfers_pending(self) -> bool:
        """Blocks held for the KV connector to send, or connector work for the workers: both
        need steps (which idle briefly on the workers) though no request is unfinished."""
        if self.connector is None:
            return False
        return self.external_kv.num_held_for_sending > 0 or self.connector.has_pending_work()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def enable_kv_cache_events(self) -> KVCacheEventLog:
        """Turns on the log of blocks cached and evicted that a data-parallel frontend routes
        by (the caller takes its events after each step)."""
        return self.kv_cache_manager.enable_kv_cache_events()

    @property
    def num_kv_cache_groups(self) -> int:
        return self.kv_cache_manager.kv_cache_config.num_groups

    @property
    def num_blocks_per_full_length_request(self) -> int:
        """Blocks one request of max_model_len tokens holds at once, over every group."""
        groups = self.kv_cache_manager.kv_cache_config.kv_cache_groups
        return blocks_per_full_length_request(self.config, groups)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens, [], [], [], [], {}, {})
        if self.drafter is not None:
            self.drafter.propose_drafts(self.running)
        self._schedule_running(plan)
        if not plan.preempted_reqs:
            self._schedule_waiting(plan)
        if self.drafter is not None:  # drafts not shipped this step are dropped
            for request in self.running:
                request.spec_token_ids = []
        output = self._make_scheduler_output(plan)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if self.config.async_scheduling and self._samples_this_step(request):
                request.num_output_placeholders += 1
        self.num_steps += 1
        return output

    @staticmethod
    def _samples_this_step(request: Request) -> bool:
        """Whether a request just scheduled reaches its last known token (placeholders
        included): the workers then sample its next one."""
        return request.num_computed_tokens == request.num_known_tokens

    def _last_token_is_pending(self, request: Request) -> bool:
        """Async scheduling: the tokens still in flight end the request by length, so
        another step would compute a token nobody may see."""
        num_pending = request.num_output_placeholders
        if not num_pending:
            return False
        max_tokens = request.max_tokens
        if max_tokens is not None and request.num_output_tokens + num_pending >= max_tokens:
            return True
        return request.num_tokens + num_pending >= self.max_model_len

    def _num_tokens_to_schedule(
        self, request: Request, num_computed_tokens: int, budget: int
    ) -> int:
        num_new_tokens = request.num_tokens_with_spec + request.num_output_placeholders
        num_new_tokens -= num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, budget)

    def _may_start(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Without chunked prefill, a waiting request starts only with all its tokens: a prompt
        the step's remaining budget cannot hold waits (and the requests behind it) for a step
        that can, rather than being split."""
        if self.config.enable_chunked_prefill:
            return True
        return num_new_tokens == request.num_tokens - num_computed_tokens

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_tokens_to_schedule(
                request, request.num_computed_tokens, plan.token_budget
            )
            if num_new_tokens <= 0 or self._last_token_is_pending(request):
                index += 1
                continue
            allocation = self._allocate_running(request, num_new_tokens, plan)
            if allocation is None:
                break
            new_blocks, num_new_tokens = allocation
            num_drafts = request.num_computed_tokens + num_new_tokens - request.num_known_tokens
            if num_drafts > 0:
                plan.spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            plan.running_reqs.append(request)
            plan.req_to_new_blocks[request.request_id] = new_blocks
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
            # A preempted victim may have sat before this request; find where it is now.
            index = self.running.index(request) + 1 if plan.preempted_reqs else index + 1

    def _allocate_running(
        self, request: Request, num_new_tokens: int, plan: _StepPlan
    ) -> tuple[KVCacheBlocks, int] | None:
        """Slots for a running request's `num_new_tokens`, drafts included: drafts are cut,
        last first, to what the free blocks hold, never preempting anyone for a draft; the
        real tokens then preempt as usual. Returns (new blocks, tokens scheduled), or None
        if the request itself was preempted."""
        num_drafts = request.num_computed_tokens + num_new_tokens - request.num_known_tokens
        num_drafts = max(0, num_drafts)
        for num_cut in range(num_drafts):
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens - num_cut)
            if new_blocks is not None:
                return new_blocks, num_new_tokens - num_cut
        num_new_tokens -= num_drafts
        new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan)
        return None if new_blocks is None else (new_blocks, num_new_tokens)

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: _StepPlan
    ) -> KVCacheBlocks | None:
        """Allocates for a running request, preempting others until it fits. Returns None if
        the request itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self._pick_preemption_victim()
            self.running.remove(victim)
            self._unschedule(victim, plan)
            self._preempt(victim)
            plan.preempted_reqs.append(victim)
            if victim is request:
                return None

    def _pick_preemption_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _unschedule(self, request: Request, plan: _StepPlan) -> None:
        """Undoes this step's scheduling of a request preempted later in the same step."""
        num_tokens = plan.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        plan.token_budget += num_tokens
        plan.running_reqs.remove(request)
        plan.req_to_new_blocks.pop(request.request_id)
        plan.spec_decode_tokens.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if request.prompt_logprobs:  # not sent yet: the prompt is computed again from the start
            request.prompt_logprobs.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    @staticmethod
    def _reads_prefix_cache(request: Request) -> bool:
        """False for a request that wants prompt logprobs: those need the logits of every
        prompt token, which cached blocks do not have."""
        return request.sampling_params.prompt_logprobs is None

    def _computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hits, for a request that reads the prefix cache."""
        if not self._reads_prefix_cache(request):
            return self.kv_cache_manager.empty_blocks(), 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _external_computed_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """Tokens after the local hit the KV connector provides, and whether they load
        asynchronously (the request then waits for them)."""
        if self.connector is None or not self._reads_prefix_cache(request):
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_local)

    def _running_lora_ids(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, request: Request, running_loras: set[int]) -> bool:
        """Whether a waiting request's adapter may join the running ones: the running requests
        never hold more than `max_loras` distinct adapters, so no step batches more."""
        if not self.config.max_loras or request.lora_request is None:
            return True
        if request.lora_int_id in running_loras:
            return True
        return len(running_loras) < self.config.max_loras

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admits waiting requests in queue order while the budget, `max_num_seqs` and the KV
        blocks allow. A request whose LoRA adapter would exceed `max_loras` is passed over (it
        keeps its place at the head of the queue, as in vLLM) and those behind it may start."""
        skipped: list[Request] = []
        running_loras = self._running_lora_ids() if self.config.max_loras else set()
        try:
            self._admit_waiting(plan, skipped, running_loras)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend_request(request)

    def _admit_waiting(
        self, plan: _StepPlan, skipped: list[Request], running_loras: set[int]
    ) -> None:
        while self.waiting and plan.token_budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek_request()
            if not self._lora_fits(request, running_loras):
                skipped.append(self.waiting.pop_request())
                continue
            computed_blocks, num_local = self._computed_blocks(request)
            num_external, load_async = self._external_computed_tokens(request, num_local)
            num_computed_tokens = num_local + num_external
            num_new_tokens = self._num_tokens_to_schedule(
                request, num_computed_tokens, plan.token_budget
            )
            if load_async:
                num_new_tokens = 0  # it only takes blocks for the tokens it waits for
            elif not self._may_start(request, num_computed_tokens, num_new_tokens):
                break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_local, computed_blocks, 0, num_external, load_async
            )
            if new_blocks is None:
                break
            # Counted on admission only: a request looked up again each step it waits counts
            # once (one back from loading its KV was counted when it started to load).
            reloaded = self.external_kv.take_loaded(request.request_id)
            if self._reads_prefix_cache(request) and not reloaded:
                self.kv_cache_manager.record_prefix_cache_stats(request, num_local)
            if self.connector is not None and self._reads_prefix_cache(request):
                blocks = self.kv_cache_manager.get_blocks(request.request_id)
                self.connector.update_state_after_alloc(request, blocks, num_external)
            self.waiting.pop_request()
            if load_async:
                self.external_kv.park(request, num_computed_tokens)
                continue
            self.running.append(request)
            if request.lora_request is not None:
                running_loras.add(request.lora_int_id)
            if request.status == RequestStatus.PREEMPTED:
                plan.resumed_reqs.append(request)
            else:
                plan.new_reqs.append(request)
            plan.req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                request.request_id
            )
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed_tokens

    def _make_scheduler_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs_data = [self._new_request_data(r, plan) for r in plan.new_reqs]
        cached_reqs_data = [
            self._cached_request_data(r, plan, resumed=True) for r in plan.resumed_reqs
        ] + [self._cached_request_data(r, plan, resumed=False) for r in plan.running_reqs]
        finished_req_ids = list(self.finished_req_ids)
        self.finished_req_ids.clear()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=[r.request_id for r in plan.preempted_reqs],
            grammars_to_prepare=self._take_grammars_to_prepare(),
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
        )

    def _new_request_data(self, request: Request, plan: _StepPlan) -> NewRequestData:
        self._num_tokens_sent[request.request_id] = request.num_prompt_tokens
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=list(plan.req_to_new_blocks[request.request_id].get_block_ids()),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
        )

    def _cached_request_data(
        self, request: Request, plan: _StepPlan, resumed: bool
    ) -> CachedRequestData:
        num_tokens_sent = self._num_tokens_sent[request.request_id]
        self._num_tokens_sent[request.request_id] = request.num_tokens
        return CachedRequestData(
            req_id=request.request_id,
            num_computed_tokens=request.num_computed_tokens,
            new_block_ids=_nonempty_groups(plan.req_to_new_blocks[request.request_id]),
            new_token_ids=request.all_token_ids[num_tokens_sent:],
            resumed_from_preemption=resumed,
        )

    # ---- results of a step ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Appends sampled tokens, applies stop conditions and frees finished requests.

        Tokens for requests that were aborted while the step ran are dropped; requests the
        worker reports in `request_errors` finish with an ERROR output (a grammar that failed
        to compile among them); those in `grammars_ready` leave WAITING_FOR_FSM for `waiting`.
        A request that verified drafts gets its rejected ones rolled back first.
        """
        outputs = []
        self._update_from_kv_connector_output(model_runner_output.kv_connector_output)
        for request_id, message in model_runner_output.request_errors.items():
            if request_id in self.requests:
                self.finish_requests(request_id, RequestStatus.FINISHED_IGNORED)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ERROR, error=message))
        self._admit_ready_grammars(model_runner_output.grammars_ready)
        for request_id, prompt_logprobs in model_runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(prompt_logprobs)
        stopped_ids = set()
        logprobs = model_runner_output.logprobs
        for index, request_id in enumerate(model_runner_output.req_ids):
            sampled_token_ids = model_runner_output.sampled_token_ids[index]
            request = self.requests.get(request_id)
            if not sampled_token_ids or request is None or request.is_finished():
                continue
            if self.config.async_scheduling:
                request.num_output_placeholders -= len(sampled_token_ids)
            # Async scheduling only: preempted while this step ran, the request still gets
            # its token (and may end with it while in the waiting queue).
            was_preempted = request.status == RequestStatus.PREEMPTED
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                num_accepted = roll_back_rejected_drafts(request, drafts, sampled_token_ids)
                self.spec_decoding_stats.observe_draft(len(drafts), num_accepted)
                self.drafter.observe_verification(request, len(drafts), num_accepted)
            new_token_ids = append_until_stop(request, sampled_token_ids, self.max_model_len)
            self.num_generation_tokens += len(new_token_ids)
            token_logprobs = logprobs[index] if logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.get_finished_reason(),
                    new_logprobs=(
                        token_logprobs[: len(new_token_ids)] if token_logprobs is not None else None
                    ),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    prompt_logprobs=request.prompt_logprobs,
                    queue_time_s=_queue_time_s(request) if request.num_output_tokens == 1 else 0.0,
                )
            )
            request.prompt_logprobs = None  # sent with the first output
            if self.config.async_scheduling:  # the workers appended them when they sampled
                self._num_tokens_sent[request_id] = request.num_tokens
            if request.is_finished():
                if was_preempted:
                    self.waiting.remove_requests([request])
                else:
                    stopped_ids.add(request_id)
                outputs[-1].kv_transfer_params = self._free_request(request)
        if stopped_ids:
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _update_from_kv_connector_output(self, output: KVConnectorOutput | None) -> None:
        """Requests whose KV loaded (or failed to) go back to the waiting queue; blocks the
        connector has sent are freed."""
        if self.connector is None or output is None:
            return
        self.connector.update_connector_output(output)
        for request in self.external_kv.finish_loads(output):
            self.waiting.add_request_in_arrival_order(request)
        self.external_kv.release_sent(output.finished_sending)

    def get_stats(self) -> SchedulerStats:
        prefix_stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_fsm) + len(self.external_kv),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits,
            prefix_cache_requests=prefix_stats.requests,
            prefix_cache_preempted_requests=prefix_stats.preempted_requests,
            prefix_cache_preempted_queries=prefix_stats.preempted_queries,
            prefix_cache_preempted_hits=prefix_stats.preempted_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            spec_decode_num_drafts=self.spec_decoding_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decoding_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decoding_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(
                self.spec_decoding_stats.num_accepted_tokens_per_pos
            ),
            **(self.connector.stats_fields() if self.connector is not None else {}),
            **self._lora_stats_fields(),
        )

    def _lora_stats_fields(self) -> dict[str, list[str]]:
        """The adapters of running and of waiting requests, each name once (LoRA on only)."""
        if not self.config.max_loras:
            return {}
        waiting = [*self.waiting, *self.waiting_for_fsm.values()]
        return {
            "running_lora_adapters": _lora_names(self.running),
            "waiting_lora_adapters": _lora_names(waiting),
        }


def _lora_names(requests: list[Request]) -> list[str]:
    return sorted({r.lora_name for r in requests if r.lora_name is not None})


def _nonempty_groups(blocks: KVCacheBlocks) -> list[list[int]]:
    """Each group's new block ids, or no list at all when no group has any (most decodes)."""
    block_ids = blocks.get_block_ids()
    return list(block_ids) if any(block_ids) else []


def _queue_time_s(request: Request) -> float:
    """How long the request waited in the core before it first ran."""
    return (request.first_scheduled_time or request.queued_time) - request.queued_time
