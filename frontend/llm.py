"""`LLM`: offline batch generation, shaped like vLLM's `LLM` class."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from core_engine.frontend.async_engine_client import Prompt
from core_engine.frontend.core_client import EngineDeadError
from core_engine.frontend.engine_client import EngineClient
from core_engine.frontend.request_output import RequestOutput
from core_engine.proto import LoRARequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig

Message = dict[str, str]
# One prompt's request: its prompt, sampling parameters, priority and LoRA adapter.
_Submission = tuple[Prompt, SamplingParams, int, LoRARequest | None]


class LLM:
    """An engine for batches of prompts: `LLM(model=None, device="auto", **engine_args)`.

    `engine_args` are `EngineConfig` fields, the same options `core-serve` takes as flags
    (max_num_seqs, tensor_parallel_size, enable_lora, max_loras, max_lora_rank, ...). model None
    serves the default SmolLM2 GGUF.

    Contract: `generate` and `chat` return one finished `RequestOutput` per prompt, in input
    order, whatever order the engine finishes them in. Use as a context manager or call
    `shutdown()` to stop the engine processes.
    """

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        *,
        address: str | None = None,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(model=model, device=device, **engine_args)
        self._client = EngineClient(config, address)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self._client.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block, so the next prompts are computed in full (for
        benchmarks that repeat a workload). False, and nothing changes, while a request
        holds blocks."""
        return self._client.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for one prompt or a list (text or token ids); one output per prompt.

        `sampling_params`: one for every prompt, or a list with one per prompt.
        `priority`: one for every prompt, or a list with one per prompt; lower values are
        scheduled first under `policy="priority"`, and only 0 (or None) is allowed under fcfs.
        `lora_request`: the LoRA adapter every prompt runs with, or a list with one per prompt
        (None: the base model); needs `enable_lora=True`, and a bad adapter is a ValueError.
        Raises ValueError (naming the prompt) before anything runs if a prompt is invalid, and
        `EngineDeadError` if the engine dies before every prompt is done: its `outputs` hold
        one output per prompt, in input order, the unfinished ones cut off with "error".
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        priorities = _as_priority_list(priority, len(prompt_list))
        lora_requests = _as_lora_request_list(lora_request, len(prompt_list))
        submissions = list(zip(prompt_list, params_list, priorities, lora_requests, strict=True))
        return self._client.run(self._generate_all(submissions, use_tqdm))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation or a list of them.

        Each conversation is a list of {"role", "content"} messages, rendered with the
        model's chat template (with the generation prompt appended). `lora_request` as in
        `generate`.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self._client.engine
        prompts = [engine.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def shutdown(self) -> None:
        self._client.shutdown()

    async def _generate_all(
        self, submissions: list[_Submission], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self._client.engine
        streams = []
        for index, (prompt, params, priority, lora_request) in enumerate(submissions):
            try:
                streams.append(
                    engine.generate(
                        prompt,
                        params,
                        stream=False,
                        priority=priority,
                        lora_request=lora_request,
                    )
                )
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from exc
        with tqdm(total=len(streams), desc="Processed prompts", disable=not use_tqdm) as bar:
            results = await asyncio.gather(
                *(_last(s, bar) for s in streams), return_exceptions=True
            )
        return _outputs_or_raise(results)


async def _last(stream: Any, bar: tqdm) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    assert final is not None and final.finished
    bar.update(1)
    return final


def _outputs_or_raise(results: list[RequestOutput | BaseException]) -> list[RequestOutput]:
    """Every prompt's final output; if the engine died, one EngineDeadError whose `outputs`
    hold every prompt's output (finished, or cut off with "error" choices) in input order;
    any other failure is raised as it is."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, EngineDeadError):
            raise result
    deaths = [result for result in results if isinstance(result, EngineDeadError)]
    if not deaths:
        return results
    outputs = [r.outputs[0] if isinstance(r, EngineDeadError) else r for r in results]
    raise EngineDeadError(deaths[0].reason, outputs)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt is a str or a list of ints; anything else is a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts


def _as_priority_list(priority: int | Sequence[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, int):
        return [priority] * num_prompts
    priorities = list(priority)
    if len(priorities) != num_prompts:
        raise ValueError(
            f"got {len(priorities)} priorities for {num_prompts} prompts; "
            "pass one for all or exactly one per prompt"
        )
    return priorities


def _as_lora_request_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    lora_requests = list(lora_request)
    if len(lora_requests) != num_prompts:
        raise ValueError(
            f"got {len(lora_requests)} LoRA requests for {num_prompts} prompts; "
            "pass one for all or exactly one per prompt"
        )
    return lora_requests


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"got {len(params_list)} SamplingParams for {num_prompts} prompts; "
            "pass one for all or exactly one per prompt"
        )
    return params_list
