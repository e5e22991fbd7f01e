"""`AsyncEngineClient`: the asyncio API of the engine, from prompts to streamed `RequestOutput`s.

It sits on a `CoreClient` (sockets to the engine core process, or to several behind a
data-parallel router) and adds what users need: tokenization, validation against the context
window, n-way fan-out, incremental detokenization, stop strings, aborts and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any

import msgspec

from core_engine.common.model_files import resolve_model_path
from core_engine.frontend.core_client import AsyncCoreClient, EngineDeadError
from core_engine.frontend.core_client_protocol import CoreClient
from core_engine.frontend.data_parallel_client import DataParallelCoreClient
from core_engine.frontend.metrics import EngineMetrics
from core_engine.frontend.output_processor import OutputProcessor
from core_engine.frontend.request_output import RequestOutput
from core_engine.frontend.structured_outputs import check_structured_outputs
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.frontend.text.unicode_text import describe_text_not_utf8
from core_engine.proto import (
    EngineCoreOutput,
    FinishReason,
    KVBlockMap,
    LoRARequest,
    SamplingParams,
    SchedulerStats,
)
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.lora_checkpoint_cache import LoRACheckpointCache
from core_engine.proto.parameter_error import ParameterError
from core_engine.proto.request_fit import check_request_fits
from core_engine.proto.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# The wire carries a request's priority as a msgpack int64.
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1


# A request the engine cannot serve: its `param` names the field at fault (the frontend's
# name for the engine's one parameter error).
InvalidPromptError = ParameterError


class ServiceStoppedError(RuntimeError):
    """`stop_serving(reason)` ended this request, or refused it; the message is the reason."""


def load_engine_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer of `config.model`: the byte tokenizer for "null", else the model's own."""
    if config.is_null_model:
        return NullTokenizer()
    from core_engine.frontend.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(config.model))


class AsyncEngineClient:
    """Serves requests on an engine core it starts (address None) or one already running.

    Contract: `generate` validates synchronously (raising `ValueError`, `EngineDeadError` when
    the core is gone, or `ServiceStoppedError` after `stop_serving`) and returns an async
    iterator; the request reaches the core when iteration starts and is aborted in the core when
    the iterator is closed or dropped before it finishes.
    With `stream=True` the iterator yields deltas (see `RequestOutput`); with `stream=False`
    exactly one final output. If the engine dies first, the iterator raises `EngineDeadError`
    whose `outputs` hold the request's output so far (never a normal end with "error" choices).
    Must be used from one event loop, the one `start` ran on.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        tokenizer: Any = None,
        model_name: str | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_engine_tokenizer(config)
        # The `model_name` label of the metrics: the served name, else the model path.
        metrics_name = model_name or config.model or "default"
        self.metrics = EngineMetrics(
            metrics_name,
            start_time_s=time.monotonic(),
            max_loras=config.max_loras if config.enable_lora else None,
        )
        # Given an address, attach to the core started there (`python -m core_engine.core
        # --frontend-address ADDRESS`); never start a second one.
        launches_cores = config.data_parallel_size > 1 or config.data_parallel_backend == "ray"
        if launches_cores and address is not None:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size} launches its own engine cores"
                f"{' (data_parallel_backend=ray)' if config.data_parallel_size == 1 else ''}; "
                f"attaching to the one at {address} serves a single core"
            )
        self._core: CoreClient = (
            DataParallelCoreClient(config)
            if launches_cores
            else AsyncCoreClient(config, address, launch_core=address is None)
        )
        self._request_id_to_processor: dict[str, OutputProcessor] = {}
        self._background_tasks: set[asyncio.Task] = set()
        self._stopped_reason: str | None = None  # set by stop_serving
        # Set once the core is ready, if it serves LoRA adapters.
        self._lora_checkpoints: LoRACheckpointCache | None = None

    async def start(self) -> None:
        """Starts (or connects to) the engine core and waits until it is ready."""
        await self._core.start()
        if (shapes := self._core.ready.lora_target_shapes) is not None:
            self._lora_checkpoints = LoRACheckpointCache(shapes)

    async def __aenter__(self) -> AsyncEngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def max_model_len(self) -> int:
        return self._core.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        """The token ids a prompt may hold: those the model runs and the tokenizer decodes."""
        return min(self.tokenizer.vocab_size, self._core.ready.vocab_size)

    @property
    def is_dead(self) -> bool:
        return self._core.is_dead

    @property
    def num_running_requests(self) -> int:
        """Requests submitted whose iterators have not finished yet."""
        return len(self._request_id_to_processor)

    async def wait_until_dead(self) -> str:
        """Returns why the engine core died, once it has (at once if it already is dead)."""
        return await self._core.wait_until_dead()

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, or a copy of a token id prompt (integers; whether they
        fit the vocabulary is `generate`'s check)."""
        if isinstance(prompt, str):
            _check_unicode(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        token_ids = list(prompt)
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ParameterError("prompt", f"prompt token id {token_id!r} is not an integer")
        return token_ids

    def check_structured_outputs(self, constraint: StructuredOutputs) -> None:
        """ParameterError unless this engine can apply `constraint`: xgrammar must build it
        (the first call imports xgrammar, seconds: run it on a thread from an event loop), and
        the model must have a vocabulary (the null model has none)."""
        if isinstance(self.tokenizer, NullTokenizer):
            raise ParameterError(
                "structured_outputs", "the null model has no vocabulary to constrain"
            )
        try:
            check_structured_outputs(constraint)
        except ValueError as exc:
            raise ParameterError("structured_outputs", str(exc)) from None

    def bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """Each bad word's token sequences: as written, and after a space (mid-sentence, most
        tokenizers spell a word differently), without duplicates."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if token_ids and token_ids not in sequences:
                    sequences.append(token_ids)
        return sequences

    async def tokenize_in_thread(self, prompt: Prompt) -> list[int]:
        """`tokenize` on a worker thread for a text prompt: a long one does not hold up the
        event loop (the tokenizer runs without the GIL), so /health and streams go on."""
        if not isinstance(prompt, str):
            return self.tokenize(prompt)
        return await asyncio.to_thread(self.tokenize, prompt)

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template; keyword
        arguments (`tools`, ...) are passed to the template."""
        for text in _strings(list(conversation)):
            _check_unicode(text, "messages")
        rendered = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        if isinstance(rendered, str):
            # The template already spells out the special tokens (bos, role markers).
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        return list(rendered)

    def check_priority(self, priority: int) -> None:
        """ParameterError unless the engine core can honour `priority`: any int64 under the
        "priority" policy (lower values run first), only 0 under "fcfs"."""
        if not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ParameterError(
                "priority",
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got "
                f"{priority!r}",
            )
        policy = self._core.ready.policy
        if priority != 0 and policy != "priority":
            raise ParameterError(
                "priority",
                f"priority {priority} needs the engine's scheduling policy to be 'priority', but "
                f"it is {policy!r}, under which every request has priority 0 (start the engine "
                "with --policy priority, or policy='priority')",
            )

    @property
    def supports_lora(self) -> bool:
        """Whether the engine serves LoRA adapters (it runs with enable_lora)."""
        return self._lora_checkpoints is not None

    def check_lora_request(self, lora_request: LoRARequest) -> None:
        """Refuses an adapter this engine cannot run: ValueError when the engine runs without
        LoRA, ParameterError (param "lora_request") naming what is wrong with its checkpoint.
        The checkpoint is read the first time a (lora_int_id, lora_path) is seen, then its
        verdict is kept: call this on a thread to keep file reads off the event loop."""
        if self._lora_checkpoints is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r}: the engine runs without LoRA "
                "adapters; start it with --enable-lora (LLM(enable_lora=True))"
            )
        self._lora_checkpoints.check(lora_request)

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream: bool = True,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submits one request (text or token ids); see the class contract for the iterator.

        `prompt_token_ids`: a text prompt's tokens when the caller already has them (from
        `tokenize_in_thread`), so they are not computed again here, on the event loop.
        `priority`: under the "priority" policy, lower values are scheduled first (and
        preempted last); any other value than 0 is refused under "fcfs" (`check_priority`).
        `lora_request`: the LoRA adapter the request runs with (None: the base model),
        checked by `check_lora_request`.
        """
        self._raise_if_not_serving()
        self.check_priority(priority)
        if lora_request is not None:
            self.check_lora_request(lora_request)
        params = sampling_params if sampling_params is not None else SamplingParams()
        for field, texts in (("stop", params.stop), ("bad_words", params.bad_words)):
            for index, text in enumerate(texts):
                _check_unicode(text, f"{field}[{index}]")
        if params.bad_words and not params.bad_words_token_ids:
            token_ids = self.bad_words_token_ids(params.bad_words)
            params = msgspec.structs.replace(params, bad_words_token_ids=token_ids)
        if prompt_token_ids is None or not isinstance(prompt, str):
            prompt_token_ids = self.tokenize(prompt)
        check_request_fits(
            prompt_token_ids,
            params,
            self._core.ready.vocab_size,
            self.max_model_len,
            prompt_vocab_size=self.vocab_size,
        )
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        if params.prompt_logprobs is not None and isinstance(self.tokenizer, NullTokenizer):
            raise ParameterError(
                "prompt_logprobs", "prompt_logprobs: the null model computes no logits"
            )
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._raise_if_running(request_id)
        processor = OutputProcessor(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_token_ids,
            params,
            self.tokenizer,
            lora_request=lora_request,
        )
        return self._run(processor, priority, stream)

    async def abort(self, request_id: str) -> None:
        """Stops a running request: its iterator ends with finish_reason "abort". No-op if done."""
        processor = self._request_id_to_processor.get(request_id)
        if processor is not None:
            # The core client finishes each aborted core request's queue with an ABORT output.
            await self._core.abort(processor.unfinished_core_request_ids)

    async def stop_serving(self, reason: str) -> None:
        """Ends every running request with `ServiceStoppedError(reason)` (freeing their KV
        blocks in the core) and refuses new ones the same way; the engine itself runs on."""
        self._stopped_reason = reason
        core_request_ids = [
            core_request_id
            for processor in self._request_id_to_processor.values()
            for core_request_id in processor.unfinished_core_request_ids
        ]
        await self._core.abort(core_request_ids, ServiceStoppedError(reason))

    async def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine core is gone."""
        self._raise_if_dead()

    async def get_stats(self) -> SchedulerStats:
        """The engine's scheduler stats (summed over data-parallel cores)."""
        self._raise_if_dead()
        return await self._core.get_stats()

    async def get_stats_per_core(self) -> list[SchedulerStats]:
        """Each engine core's stats, in data-parallel rank order (one entry for one core)."""
        self._raise_if_dead()
        return await self._core.get_stats_per_core()

    async def get_kv_block_maps(self) -> list[KVBlockMap]:
        """Each engine core's KV block map, in data-parallel rank order."""
        self._raise_if_dead()
        return await self._core.get_kv_block_maps()

    async def reset_prefix_cache(self) -> bool:
        """True if the prefix cache was reset; False while requests hold KV blocks."""
        self._raise_if_dead()
        return await self._core.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stops the engine core (if this client started it) and every background task."""
        for task in list(self._background_tasks):
            task.cancel()
        await self._core.shutdown()

    def _raise_if_running(self, request_id: str) -> None:
        if request_id in self._request_id_to_processor:
            raise ValueError(f"request id {request_id!r} is already running")

    def _raise_if_dead(self) -> None:
        if self._core.is_dead:
            raise EngineDeadError(self._core.dead_reason or "the engine core is dead")

    def _raise_if_not_serving(self) -> None:
        """EngineDeadError, or ServiceStoppedError after `stop_serving`."""
        self._raise_if_dead()
        if self._stopped_reason is not None:
            raise ServiceStoppedError(self._stopped_reason)

    async def _run(
        self, processor: OutputProcessor, priority: int, stream: bool
    ) -> AsyncIterator[RequestOutput]:
        request_id = processor.request_id
        arrival_time_s = time.monotonic()
        eos_token_ids = self._core.ready.eos_token_ids  # the model's, from the workers
        core_requests = processor.make_core_requests(eos_token_ids, time.time(), priority)
        forwarders: list[asyncio.Task] = []
        submitted = False
        self._raise_if_running(request_id)
        self._request_id_to_processor[request_id] = processor
        try:
            self._raise_if_not_serving()
            core_queues = [self._core.add_request(request) for request in core_requests]
            queue = core_queues[0] if len(core_queues) == 1 else asyncio.Queue()
            if len(core_queues) > 1:
                forwarders = [self._spawn(_forward(q, queue)) for q in core_queues]
            self.metrics.record_request(len(processor.prompt_token_ids))
            submitted = True
            while not processor.finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    processor.abort(_finish_reason_of(item))
                    raise item
                self._process(processor, item, arrival_time_s)
                self._record_finished(processor, arrival_time_s)
                if stream and (delta := processor.make_delta_output()) is not None:
                    yield delta
            if not stream:
                yield processor.make_final_output()
        except EngineDeadError as exc:
            processor.abort(FinishReason.ERROR)
            raise _with_output_so_far(exc, processor) from None
        finally:
            del self._request_id_to_processor[request_id]
            for task in forwarders:
                task.cancel()
            if unfinished := processor.unfinished_core_request_ids:
                processor.abort()  # the caller left (a client disconnect, a cancelled task)
                self._abort_in_background(unfinished)
            if submitted:
                self._record_finished(processor, arrival_time_s)

    def _process(
        self, processor: OutputProcessor, output: EngineCoreOutput, arrival_time_s: float
    ) -> None:
        choice = processor.choice(output.request_id)
        if output.new_token_ids and not choice.finished:
            now_s = time.monotonic()
            if choice.last_token_time is None:
                self.metrics.time_to_first_token.observe(now_s - arrival_time_s)
            else:
                self.metrics.inter_token_latency.observe(now_s - choice.last_token_time)
            choice.last_token_time = now_s
            self.metrics.record_tokens(len(output.new_token_ids))
        if output.queue_time_s:
            self.metrics.request_queue_time.observe(output.queue_time_s)
        if output.finish_reason == FinishReason.ERROR:
            logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
        if processor.process(output):
            self._abort_in_background([output.request_id])

    def _record_finished(self, processor: OutputProcessor, arrival_time_s: float) -> None:
        """Counts each choice once, when it ends, by how it ended (stop, length, abort,
        error), whoever ended it: the core, a stop string, an abort or a client that left."""
        for choice in processor.take_newly_finished():
            assert choice.finish_reason is not None
            self.metrics.record_finished(choice.finish_reason)
            self.metrics.e2e_request_latency.observe(time.monotonic() - arrival_time_s)

    def _abort_in_background(self, core_request_ids: list[str]) -> None:
        """Aborts without awaiting, so that it also works from a cancelled iterator's cleanup."""
        if not self._core.is_dead:
            self._spawn(self._core.abort(core_request_ids))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)
        return task


async def _forward(source: asyncio.Queue, target: asyncio.Queue) -> None:
    """Moves one core request's outputs into its parent request's queue until it finishes."""
    while True:
        item = await source.get()
        target.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            return


def _with_output_so_far(error: EngineDeadError, processor: OutputProcessor) -> EngineDeadError:
    """A new EngineDeadError carrying the request's output so far (its unfinished choices
    already marked "error" by the caller)."""
    processor.error = processor.error or error.reason
    return EngineDeadError(error.reason, [processor.make_final_output()])


def _finish_reason_of(error: BaseException) -> FinishReason:
    """How a request that `error` ended is counted: ABORT when the server stopped serving it,
    ERROR when the engine died (or anything else failed it)."""
    return FinishReason.ABORT if isinstance(error, ServiceStoppedError) else FinishReason.ERROR


def _check_unicode(text: str, param: str) -> None:
    """InvalidPromptError for text that is not valid Unicode (a lone surrogate, which JSON's
    \\uD800 escapes can carry): no tokenizer can encode it."""
    reason = describe_text_not_utf8(text)
    if reason is not None:
        raise ParameterError(param, f"{param} is not valid Unicode text: {reason}")


def _strings(value: Any) -> Iterator[str]:
    """Every string inside nested lists and dicts (a message's text, its tool calls' fields)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
