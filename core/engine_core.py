"""`EngineCore`: the scheduler and the model executor, advanced one step at a time, and the
start-up handshake that builds it (`start_engine_core`).

No sockets and no threads here: `EngineCoreProc` adds those for the engine core process, and
`InProcessEngine` steps the same core in the caller's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from core_engine.core.executor.executor import Executor, ModelExecutor
from core_engine.core.kv_cache.kv_block_map import build_kv_block_map
from core_engine.core.kv_cache.kv_cache_spec import KVCacheConfig
from core_engine.core.kv_connector.kv_connector_factory import make_kv_connector
from core_engine.core.lora_adapter_check import LoRAAdapterCheck
from core_engine.core.request import Request, RequestStatus
from core_engine.core.sched.scheduler import Scheduler
from core_engine.core.sched.scheduler_config import SchedulerConfig
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    KVBlockMap,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.engine_messages import MAX_KV_BLOCK_MAP_CELLS
from core_engine.proto.request_fit import check_request_fits

# Runs one step on the workers: `ModelExecutor.execute_model`, or the engine core process's own
# (which serves its frontend socket while the workers run).
StepRunner = Callable[[SchedulerOutput], ModelRunnerOutput]


class EngineCore:
    """Steps `scheduler` with `executor`; not thread-safe (only the busy loop calls it).

    Contract: every request passed to `add_request` ends in exactly one way: an error output
    returned by `add_request` (rejected), one finished output from `step` (stop, length), or
    `abort_requests` (no output: whoever aborted it already knows).
    """

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: Request) -> EngineCoreOutput | None:
        """Queues `request`; returns an ERROR output instead if the scheduler refuses it."""
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            return make_error_output(request.request_id, f"request rejected: {exc}")
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        """Frees the requests' blocks now; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def has_work(self) -> bool:
        """True while a request is unfinished, or a finished one's KV blocks are held for a KV
        connector to send (their release arrives with a step).

        Finished ids alone are no reason for a step: they ride along with the next step's
        `SchedulerOutput`, so a finishing request costs no extra round trip to the workers
        (which keep its state a little longer, until that step).
        """
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_kv_transfers_pending()

    def step(self, run_step: StepRunner | None = None) -> EngineCoreOutputs | None:
        """The engine's one step, wherever it runs (the engine core process, an in-process
        engine): schedules, runs the step (`run_step`, default the executor's
        `execute_model`), applies the sampled tokens. The outputs for clients, or None when
        there was no work (nothing was scheduled or run)."""
        scheduler_output = self.schedule_step()
        if scheduler_output is None:
            return None
        run_step = run_step or self.executor.execute_model
        return self.finish_step(scheduler_output, run_step(scheduler_output))

    def schedule_step(self) -> SchedulerOutput | None:
        """The next step's plan, or None when there is no work. Under async scheduling it may
        be called again before the last plan's `finish_step`: output placeholders stand for
        the tokens in flight (see `Scheduler`)."""
        return self.scheduler.schedule() if self.has_work else None

    def finish_step(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Applies a step's sampled tokens (steps finish in the order they were planned)."""
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def get_kv_block_map(self) -> KVBlockMap:
        """Every block's state, in at most `MAX_KV_BLOCK_MAP_CELLS` cells."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return build_kv_block_map(pool, MAX_KV_BLOCK_MAP_CELLS)

    def reset_prefix_cache(self) -> bool:
        """False (and nothing changes) while any request holds KV blocks."""
        return self.scheduler.reset_prefix_cache()


def start_engine_core(config: EngineConfig, executor: Executor) -> tuple[EngineCore, EngineReady]:
    """The start-up handshake: waits for every worker, sizes the KV pool (the override, else the
    minimum over workers), has the workers allocate it, and returns the core with the
    `EngineReady` that describes it.

    The scheduler's limits are the tightest of the config's and every worker's; a worker built
    for another block size is a ValueError (its block table would not match the core's).
    """
    readies = executor.wait_until_ready()
    for ready in readies:
        if ready.block_size != config.block_size:
            raise ValueError(
                f"worker rank {ready.rank} has block_size={ready.block_size}, the engine "
                f"{config.block_size}"
            )
    num_gpu_blocks = config.num_gpu_blocks_override or min(r.num_gpu_blocks for r in readies)
    max_model_len = min(r.max_model_len for r in readies)
    max_num_batched_tokens = min(r.max_num_batched_tokens for r in readies)
    scheduler_config = SchedulerConfig(
        max_num_seqs=min(config.max_num_seqs, *(r.max_num_seqs for r in readies)),
        max_num_batched_tokens=min(
            config.max_num_batched_tokens or max_num_batched_tokens, max_num_batched_tokens
        ),
        max_model_len=min(config.max_model_len or max_model_len, max_model_len),
        block_size=config.block_size,
        num_gpu_blocks=num_gpu_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.policy,
        enable_chunked_prefill=config.enable_chunked_prefill,
        speculative_config=config.speculative_config,
        max_loras=config.max_loras if config.enable_lora else 0,
        async_scheduling=config.async_scheduling,
    )
    kv_cache_config = KVCacheConfig.for_layers(
        readies[0].layer_sliding_windows,
        config.block_size,
        scheduler_config.max_model_len,
        hybrid=not config.disable_hybrid_kv_cache,
    )
    connector = make_kv_connector(config, readies, kv_cache_config)
    executor.initialize_cache(num_gpu_blocks)
    ready = EngineReady(
        num_gpu_blocks,
        config.block_size,
        scheduler_config.max_model_len,
        scheduler_config.max_num_batched_tokens,
        min(r.vocab_size for r in readies),
        list(readies[0].eos_token_ids),
        scheduler_config.policy,
        readies[0].lora_target_shapes if config.enable_lora else None,
    )
    return EngineCore(Scheduler(scheduler_config, kv_cache_config, connector), executor), ready


def make_request(
    core_request: EngineCoreRequest,
    ready: EngineReady,
    lora_check: LoRAAdapterCheck | None = None,
) -> Request:
    """The scheduler's `Request` for a wire request, once it is known to fit the engine
    `ready` describes (`check_request_fits`: the frontend never sends one that does not; a raw
    client might, and the model would fail on it); hashes its full prompt blocks (slow part).

    Raises ParameterError naming the field that does not fit, or the adapter that cannot run
    (`lora_check`: one that remembers verdicts; None checks afresh).
    """
    check_request_fits(
        core_request.prompt_token_ids,
        core_request.sampling_params,
        ready.vocab_size,
        ready.max_model_len,
    )
    (lora_check or LoRAAdapterCheck(ready.lora_target_shapes)).check(core_request.lora_request)
    return Request(
        request_id=core_request.request_id,
        prompt_token_ids=core_request.prompt_token_ids,
        sampling_params=core_request.sampling_params,
        eos_token_id=core_request.eos_token_id,
        arrival_time=core_request.arrival_time or None,
        priority=core_request.priority,
        block_size=ready.block_size,
        lora_request=core_request.lora_request,
    )


def make_error_output(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], FinishReason.ERROR, error=message)


def make_outputs(outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=outputs, timestamp=time.time())
