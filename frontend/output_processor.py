"""`OutputProcessor`: one request's state in the frontend, from core outputs to `RequestOutput`s.

A request with `n` choices runs as `n` core requests (derived ids and seeds); the processor fans
them back in, detokenizes each choice incrementally and applies stop strings, which the core
does not see: a matched stop string ends the choice here and asks the caller to abort its core
request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from core_engine.frontend.request_output import CompletionOutput, RequestOutput
from core_engine.frontend.text.detokenizer import Decoder, IncrementalDetokenizer
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    SamplingParams,
    TokenLogprobs,
)
from core_engine.proto.sampling_params import stop_on_eos


def core_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's core requests: the request's own id when n == 1, else `i_id`."""
    if n == 1:
        return [request_id]
    return [f"{index}_{request_id}" for index in range(n)]


def find_stop_string(text: str, stop: Sequence[str], num_new_chars: int) -> tuple[int, str] | None:
    """The earliest (position, stop string) match that ends in the last `num_new_chars` of text."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        start = max(0, len(text) - num_new_chars - len(stop_string) + 1)
        position = text.find(stop_string, start)
        if position >= 0 and (best is None or position < best[0]):
            best = (position, stop_string)
    return best


def num_stop_prefix_chars(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    Those characters may turn out to be the start of a stop string, so a stream holds them back.
    """
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest


@dataclass(slots=True)
class ChoiceState:
    """One choice of a request.

    Invariants: `text` holds no stop string; `text[:num_sent_chars]` and
    `token_ids[:num_sent_tokens]` went out in delta outputs, and `finish_sent` says whether the
    finish reason did too; `finish_taken` says whether `take_newly_finished` returned it.
    """

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    finish_sent: bool = False
    finish_taken: bool = False
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Turns the outputs of one request's core requests into `RequestOutput`s.

    Contract: `process` accepts outputs of any of the request's core requests in any
    interleaving and ignores those of a choice that already finished (e.g. the core's answer
    to an abort after a stop string). A streamed output's text never includes characters that
    could still become part of a stop string; the final output's text is cut before the stop
    string. The request is finished when every choice is. `lora_request`: the adapter every
    choice runs with (None: the base model).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tokenizer: Decoder,
        *,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.lora_request = lora_request
        self.core_request_ids = core_request_ids(request_id, sampling_params.n)
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self._choices = [
            ChoiceState(
                index,
                IncrementalDetokenizer(
                    tokenizer, prompt_token_ids, sampling_params.skip_special_tokens
                ),
                logprobs=[] if sampling_params.logprobs is not None else None,
            )
            for index in range(sampling_params.n)
        ]
        self._core_id_to_choice = dict(zip(self.core_request_ids, self._choices, strict=True))

    def make_core_requests(
        self,
        eos_token_ids: Sequence[int],
        arrival_time: float,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """One core request per choice: n = 1, seed + index, the eos rule of `stop_on_eos`."""
        eos_token_id, params = stop_on_eos(self.sampling_params, eos_token_ids)
        return [
            EngineCoreRequest(
                request_id=core_id,
                prompt_token_ids=self.prompt_token_ids,
                sampling_params=msgspec.structs.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + index,
                    # The prompt is the same for every choice: one computes its logprobs.
                    prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                ),
                eos_token_id=eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=self.lora_request,
            )
            for index, core_id in enumerate(self.core_request_ids)
        ]

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self._choices)

    @property
    def unfinished_core_request_ids(self) -> list[str]:
        return [
            core_id for core_id, choice in self._core_id_to_choice.items() if not choice.finished
        ]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self._choices)

    def choice(self, core_request_id: str) -> ChoiceState:
        return self._core_id_to_choice[core_request_id]

    def process(self, output: EngineCoreOutput) -> bool:
        """Applies one core output. Returns True iff its core request must now be aborted."""
        choice = self._core_id_to_choice[output.request_id]
        if choice.finished:
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *output.prompt_logprobs]
        choice.token_ids.extend(output.new_token_ids)
        if choice.logprobs is not None and output.new_logprobs:
            choice.logprobs.extend(output.new_logprobs)
        new_text = choice.detokenizer.update(output.new_token_ids)
        if output.finished:
            new_text += choice.detokenizer.flush()
        choice.text += new_text
        if self._apply_stop_strings(choice, len(new_text)):
            return not output.finished
        if output.finished:
            self._finish(choice, output)
        return False

    def abort(self, finish_reason: FinishReason = FinishReason.ABORT) -> None:
        """Marks every running choice finished: aborted (the caller aborts their core
        requests), or with ERROR when the engine failed them."""
        for choice in self._choices:
            if not choice.finished:
                choice.finish_reason = str(finish_reason)

    def take_newly_finished(self) -> list[ChoiceState]:
        """The choices that finished since the last call, however they ended (the core, a
        stop string, an abort): each finished choice is returned by exactly one call."""
        newly_finished = [c for c in self._choices if c.finished and not c.finish_taken]
        for choice in newly_finished:
            choice.finish_taken = True
        return newly_finished

    def make_delta_output(self) -> RequestOutput | None:
        """What changed since the last delta output; None when nothing did."""
        outputs = [
            completion
            for choice in self._choices
            if (completion := self._take_delta(choice)) is not None
        ]
        if not outputs:
            return None
        return self._make_output(outputs)

    def make_final_output(self) -> RequestOutput:
        """Every choice in full (cumulative text, token ids and logprobs)."""
        outputs = [
            CompletionOutput(
                index=choice.index,
                text=choice.text,
                token_ids=choice.token_ids,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                logprobs=choice.logprobs,
            )
            for choice in self._choices
        ]
        return self._make_output(outputs)

    def _make_output(self, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_generated_tokens=self.num_generated_tokens,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params,
            lora_request=self.lora_request,
        )

    def _apply_stop_strings(self, choice: ChoiceState, num_new_chars: int) -> bool:
        params = self.sampling_params
        if not params.stop or len(choice.token_ids) < params.min_tokens:
            return False
        match = find_stop_string(choice.text, params.stop, num_new_chars)
        if match is None:
            return False
        position, stop_string = match
        if params.include_stop_str_in_output:
            position += len(stop_string)
        choice.text = choice.text[:position]
        choice.finish_reason = str(FinishReason.STOP)
        choice.stop_reason = stop_string
        return True

    def _finish(self, choice: ChoiceState, output: EngineCoreOutput) -> None:
        assert output.finish_reason is not None
        choice.finish_reason = str(output.finish_reason)
        choice.stop_reason = output.stop_reason
        if output.error is not None:
            self.error = output.error
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params.to_json_object()

    def _take_delta(self, choice: ChoiceState) -> CompletionOutput | None:
        num_sendable_chars = len(choice.text)
        params = self.sampling_params
        if not choice.finished and not params.include_stop_str_in_output:
            # What may become a stop string is held back; included, it is sent either way.
            num_sendable_chars -= num_stop_prefix_chars(choice.text, params.stop)
        num_sendable_chars = max(num_sendable_chars, choice.num_sent_chars)
        has_news = (
            num_sendable_chars > choice.num_sent_chars
            or len(choice.token_ids) > choice.num_sent_tokens
            or (choice.finished and not choice.finish_sent)
        )
        if not has_news:
            return None
        completion = CompletionOutput(
            index=choice.index,
            text=choice.text[choice.num_sent_chars : num_sendable_chars],
            token_ids=choice.token_ids[choice.num_sent_tokens :],
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            logprobs=None if choice.logprobs is None else choice.logprobs[choice.num_sent_tokens :],
        )
        choice.num_sent_chars = num_sendable_chars
        choice.num_sent_tokens = len(choice.token_ids)
        choice.finish_sent = choice.finished
        return completion
