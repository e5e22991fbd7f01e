"""A request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from core_engine.common.block_hash import BlockHash, block_extra_keys, hash_block_tokens
from core_engine.proto import FinishReason, LoRARequest, SamplingParams, TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one.

    WAITING_FOR_FSM: a constrained request whose grammar the workers are still compiling; it
    holds no blocks and joins the waiting queue (as WAITING) once rank 0 reports it ready.
    WAITING_FOR_REMOTE_KVS: a request whose prefix a KV connector is loading into blocks it
    holds; it rejoins the waiting queue, with those tokens computed, once rank 0 reports them.
    """

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _STATUS_TO_FINISH_REASON.get(status)


_STATUS_TO_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.ERROR,
}


class Request:
    """Prompt plus generated tokens, with the chained hashes of every full block.

    Invariant: `len(block_hashes) == num_tokens // block_size`; hashes are appended as tokens
    arrive, each chained to the previous one, the first keyed by `sampling_params.cache_salt`
    too, and by the LoRA adapter's name (`common.block_hash.block_extra_keys`), so prefix hits
    never cross adapters. `num_computed_tokens` counts tokens whose KV is
    in the cache (or scheduled to be written this step).

    `spec_token_ids`: draft tokens proposed for the next step (speculative decoding), never
    part of `all_token_ids` nor of any block hash; empty except between the drafter's
    proposal and the scheduling pass that ships them (or drops them).

    `num_output_placeholders` (async scheduling): tokens sampled by steps still in flight, not
    yet in `all_token_ids`; the workers know them, so the next step may already compute them.
    At most 2 (the step running and the one queued behind it); 0 without async scheduling.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_size: int = 16,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.block_size = block_size
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Core-side times (monotonic): when the request joined the queue and first ran.
        self.queued_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.stop_reason: int | None = None
        self.max_tokens = sampling_params.max_tokens
        # Prompt logprobs gathered over the prefill chunks until the first output carries
        # them (then None: a recomputation after a preemption adds nothing).
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None
        )
        self.spec_token_ids: list[int] = []
        self.num_output_placeholders = 0
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the workers hold: the real ones plus those sampled by steps in flight."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens the next step may compute up to: the real ones plus the drafts."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        for token_id in token_ids:
            self._output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
        self._update_block_hashes()

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def _update_block_hashes(self) -> None:
        size = self.block_size
        cache_salt = self.sampling_params.cache_salt
        lora_name = self.lora_name
        while (len(self.block_hashes) + 1) * size <= self.num_tokens:
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else None
            token_ids = self._all_token_ids[start : start + size]
            self.block_hashes.append(
                hash_block_tokens(parent, token_ids, block_extra_keys(start, cache_salt, lora_name))
            )

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower `priority` value first, then earlier arrival, then id."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
