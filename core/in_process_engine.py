"""`InProcessEngine`: the engine core stepped in the caller's thread, with no sockets.

The same start-up handshake (`start_engine_core`), eos rule and step (`EngineCore.step`) as the
engine core process; the executor is anything with the executor's verbs, usually
`worker.local_executor.LocalExecutor` around one worker in this process (`core/` cannot import
`worker/`, so the caller builds it). `scripts/generate.py`, the tests and the benchmarks run the
engine this way. `run_requests` is the loop itself, for callers with their own scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from core_engine.core.engine_core import EngineCore, start_engine_core
from core_engine.core.executor.executor import Executor, ModelExecutor
from core_engine.core.lora_adapter_check import LoRAAdapterCheck
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler
from core_engine.proto import LoRARequest, SamplingParams, SchedulerStats, TokenLogprobs
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.request_fit import check_request_fits
from core_engine.proto.sampling_params import stop_on_eos


@dataclass(slots=True)
class GenerationResult:
    """One request's generated tokens (prompt excluded) and why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., when asked


@dataclass(slots=True)
class GenerationOutput:
    """Results in request order; `stats` counts this workload only (its steps, tokens,
    preemptions, prefix-cache tokens), `elapsed_s` is its wall time."""

    results: list[GenerationResult]
    stats: SchedulerStats
    elapsed_s: float


class TextCodec(Protocol):
    """What `generate_text` needs of a tokenizer (`frontend.text.tokenizer.Tokenizer` has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class InProcessEngine:
    """Start-up handshake on construction, then whole workloads through `generate`.

    Each `generate` call starts from the state the last one left: with prefix caching on, a
    later workload may hit blocks an earlier one cached.
    """

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.executor = executor
        self.engine_core, self.ready = start_engine_core(config, executor)
        self.lora_check = LoRAAdapterCheck(self.ready.lora_target_shapes)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] | None = None,
        lora_requests: Sequence[LoRARequest | None] | None = None,
    ) -> GenerationOutput:
        """Runs the prompts as one continuously batched workload; results in prompt order.
        `eos_token_ids` default to the model's (`EngineReady`); `lora_requests`: each prompt's
        adapter (None: the base model), for an engine with enable_lora."""
        if eos_token_ids is None:
            eos_token_ids = self.ready.eos_token_ids
        for ids in prompt_token_ids:
            check_request_fits(
                ids, sampling_params, self.ready.vocab_size, self.ready.max_model_len
            )
        for lora_request in lora_requests or ():
            self.lora_check.check(lora_request)
        requests = make_requests(
            prompt_token_ids, sampling_params, eos_token_ids, self.ready.block_size, lora_requests
        )
        return run_requests(self.engine_core.scheduler, self.executor, requests)

    def generate_text(
        self, prompts: Sequence[str], tokenizer: TextCodec, sampling_params: SamplingParams
    ) -> GenerationOutput:
        """`generate` for text prompts (encoded as they are, no chat template); each result's
        `text` is its tokens decoded."""
        output = self.generate([tokenizer.encode(p) for p in prompts], sampling_params)
        for result in output.results:
            result.text = tokenizer.decode(result.token_ids)
        return output


def make_requests(
    prompt_token_ids: Sequence[Sequence[int]],
    sampling_params: SamplingParams,
    eos_token_ids: Sequence[int],
    block_size: int,
    lora_requests: Sequence[LoRARequest | None] | None = None,
) -> list[Request]:
    """One request per prompt, ids "0", "1", ...; every eos id stops unless ignore_eos."""
    eos_token_id, sampling_params = stop_on_eos(sampling_params, eos_token_ids)
    if lora_requests is None:
        lora_requests = [None] * len(prompt_token_ids)
    return [
        Request(
            str(i),
            list(ids),
            sampling_params,
            eos_token_id=eos_token_id,
            block_size=block_size,
            lora_request=lora_request,
        )
        for i, (ids, lora_request) in enumerate(zip(prompt_token_ids, lora_requests, strict=True))
    ]


def run_requests(
    scheduler: Scheduler, executor: ModelExecutor, requests: Sequence[Request]
) -> GenerationOutput:
    """Adds `requests` and steps `EngineCore` until all finish; results in the order of
    `requests`, their tokens exactly what a client of the engine core would receive."""
    engine_core = EngineCore(scheduler, executor)
    results = {
        r.request_id: GenerationResult(r.request_id, list(r.prompt_token_ids)) for r in requests
    }
    before = scheduler.get_stats()
    for request in requests:
        scheduler.add_request(request)
    start = time.perf_counter()
    while (engine_outputs := engine_core.step()) is not None:
        for output in engine_outputs.outputs:
            result = results[output.request_id]
            result.token_ids.extend(output.new_token_ids)
            result.logprobs.extend(output.new_logprobs or [])
            if output.prompt_logprobs is not None:
                result.prompt_logprobs = output.prompt_logprobs
            if output.finish_reason is not None:
                result.finish_reason = str(output.finish_reason)
    elapsed_s = time.perf_counter() - start
    stats = scheduler.get_stats().increase_since(before)
    return GenerationOutput([results[r.request_id] for r in requests], stats, elapsed_s)
