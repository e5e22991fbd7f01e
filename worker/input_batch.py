"""The persistent batch: per-request rows that survive across steps, updated from diffs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from core_engine.common.math_utils import cdiv
from core_engine.proto import SamplingParams
from core_engine.proto.lora_request import LoRARequest
from core_engine.worker.block_table import MultiGroupBlockTable
from core_engine.worker.sample.sampler import RowPenalties, SamplingFlags, SamplingMetadata
from core_engine.worker.step_transfer import StepTransfer


@dataclass(slots=True)
class CachedRequestState:
    """Everything the worker knows about one request, whether it is in the batch this step or not.

    `output_token_ids` are the tokens the scheduler reported (CachedRequestData.new_token_ids),
    never the worker's own samples, so every rank holds the same history.
    `generator` is set iff the request has a seed; it lives as long as the request.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter its tokens go through

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of request state as numpy arrays, so per-step inputs are built without Python loops.

    Invariants: `req_ids[row]` is None iff the row is a hole; `req_id_to_row` maps each occupied
    row's id to its row; after `condense()` rows `0..num_reqs-1` are exactly the occupied ones.
    `token_ids[row, :num_tokens[row]]` is the request's prompt followed by its output tokens;
    `num_prompt_tokens[row] <= num_tokens[row] <= max_model_len`. The draft tokens a row verifies
    this step (`set_draft_token_ids`, after `condense`) follow its history:
    `token_ids[row, num_tokens[row] : num_tokens[row] + num_draft_tokens[row]]`; they are not
    part of it, and the next step's `set_draft_token_ids` clears them.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.sampling_transfer = StepTransfer(device)  # sampling parameters in one copy
        self.eos_token_ids = list(eos_token_ids)
        max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.block_table = MultiGroupBlockTable(
            num_kv_cache_groups, max_num_reqs, max_num_blocks_per_req, block_size, device
        )

        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self._num_rows = 0  # high-water mark: rows >= this are all holes

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.has_draft_tokens = False  # whether some row verifies drafts this step
        # Bumped whenever a row gets, loses or moves a request: the key of the reusable metadata.
        self._rows_version = 0
        self._reusable_metadata: tuple[tuple, SamplingMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, state: CachedRequestState) -> int:
        """Puts the request into the lowest free row and returns that row."""
        if state.req_id in self.req_id_to_row:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        row = self._first_free_row()
        self.req_ids[row] = state.req_id
        self.req_id_to_row[state.req_id] = row
        self._num_rows = max(self._num_rows, row + 1)

        self.num_tokens[row] = 0
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.append_token_ids(row, state.prompt_token_ids)
        self.append_token_ids(row, state.output_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self._set_sampling_params(row, state.sampling_params, state.generator)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Empties the request's row, leaving a hole; returns the row, or None if absent."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self._rows_version += 1
        self.sampling_params[row] = None
        self.generators.pop(row, None)
        self.block_table.clear_row(row)
        return row

    def condense(self) -> None:
        """Moves the last occupied rows into the holes so that rows 0..num_reqs-1 are occupied."""
        num_reqs = self.num_reqs
        last = self._num_rows - 1
        for hole in range(num_reqs):
            if self.req_ids[hole] is not None:
                continue
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self._num_rows = num_reqs

    def append_token_ids(self, row: int, token_ids: Sequence[int]) -> None:
        """Appends tokens to the row's history; raises past max_model_len."""
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def set_draft_token_ids(self, req_id_to_draft_token_ids: dict[str, list[int]]) -> None:
        """This step's drafts (speculative decoding), placed after each request's history;
        every other row has none. Raises for a request not in the batch, or drafts that would
        reach past max_model_len."""
        self.num_draft_tokens[:] = 0
        self.has_draft_tokens = any(req_id_to_draft_token_ids.values())
        for req_id, draft_token_ids in req_id_to_draft_token_ids.items():
            row = self.req_id_to_row.get(req_id)
            if row is None:
                raise ValueError(f"drafts for request {req_id!r}, which is not scheduled")
            start = int(self.num_tokens[row])
            end = start + len(draft_token_ids)
            if end > self.max_model_len:
                raise ValueError(
                    f"request {req_id!r} with {len(draft_token_ids)} drafts would reach "
                    f"{end} tokens, more than max_model_len={self.max_model_len}"
                )
            self.token_ids[row, start:end] = draft_token_ids
            self.num_draft_tokens[row] = len(draft_token_ids)

    def draft_token_ids(self, row: int) -> list[int]:
        start = int(self.num_tokens[row])
        return self.token_ids[row, start : start + self.num_draft_tokens[row]].tolist()

    def sampling_metadata(
        self, rows: np.ndarray, num_draft_prefix: np.ndarray | None = None
    ) -> SamplingMetadata:
        """Sampling parameters of `rows` (in that order) as device tensors for the Sampler.

        With `num_draft_prefix`, entry i describes the position after row `rows[i]`'s history
        extended by its first `num_draft_prefix[i]` drafts: penalties count those drafts as
        output, min_tokens counts them, bad words may end in them. A row may appear several
        times (once per position it verifies).

        Without drafts, a call for the same rows as the last call, when no row has had its
        request changed since and none has metadata that depends on its history (penalties,
        min_tokens, bad words), returns the last call's metadata object: its tensors are the
        last transfer's, valid until the next one (see StepTransfer), which only a call that
        builds new metadata makes."""
        row_list = rows.tolist()
        key = (self._rows_version, tuple(row_list)) if num_draft_prefix is None else None
        reusable = self._reusable_metadata
        if key is not None and reusable is not None and reusable[0] == key:
            return reusable[1]
        metadata = self._build_sampling_metadata(rows, row_list, num_draft_prefix)
        params = (self.sampling_params[row] for row in row_list)
        static = key is not None and not any(map(_depends_on_history, params))
        self._reusable_metadata = (key, metadata) if static else None
        return metadata

    def _build_sampling_metadata(
        self, rows: np.ndarray, row_list: list[int], num_draft_prefix: np.ndarray | None
    ) -> SamplingMetadata:
        params = [self.sampling_params[row] for row in row_list]
        history = self.num_tokens[rows].astype(np.int64)
        if num_draft_prefix is not None:
            history = history + num_draft_prefix
        history_list = history.tolist()
        temperature, top_k, top_p, min_p = self.sampling_transfer.send(
            [self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows]]
        )
        return SamplingMetadata(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={
                i: self.generators[row] for i, row in enumerate(row_list) if row in self.generators
            },
            num_logprobs=[p.logprobs if p is not None else None for p in params],
            banned_token_ids=self._banned_token_ids(row_list, params, history_list),
            logit_bias={
                i: (list(p.logit_bias), list(p.logit_bias.values()))
                for i, p in enumerate(params)
                if p is not None and p.logit_bias
            },
            penalties={
                i: self._row_penalties(row, p, history_list[i])
                for i, (row, p) in enumerate(zip(row_list, params, strict=True))
                if p is not None and p.has_penalties
            },
            flags=SamplingFlags.of(
                self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows]
            ),
        )

    def _row_penalties(self, row: int, params: SamplingParams, num_tokens: int) -> RowPenalties:
        """Penalties over the row's first `num_tokens` tokens (history, maybe some drafts)."""
        num_prompt_tokens = int(self.num_prompt_tokens[row])
        token_ids = self.token_ids[row]
        return RowPenalties(
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
            prompt_token_ids=self._to_device(token_ids[:num_prompt_tokens].astype(np.int64)),
            output_token_ids=self._to_device(
                token_ids[num_prompt_tokens:num_tokens].astype(np.int64)
            ),
        )

    def _banned_token_ids(
        self, rows: list[int], params: list[SamplingParams | None], num_tokens: list[int]
    ) -> dict[int, list[int]]:
        """Stop tokens while a request has fewer than min_tokens outputs, and every token that
        would complete one of its bad words, after row i's first `num_tokens[i]` tokens."""
        banned: dict[int, list[int]] = {}
        for i, (row, p, end) in enumerate(zip(rows, params, num_tokens, strict=True)):
            if p is None or (p.min_tokens == 0 and not p.bad_words_token_ids):
                continue  # the common case costs no array arithmetic
            num_output_tokens = end - int(self.num_prompt_tokens[row])
            row_banned = []
            if num_output_tokens < p.min_tokens:
                row_banned.extend(p.stop_token_ids)
                if not p.ignore_eos:
                    row_banned.extend(self.eos_token_ids)
            if p.bad_words_token_ids:
                output = self.token_ids[row, self.num_prompt_tokens[row] : end]
                row_banned.extend(_bad_word_endings(p.bad_words_token_ids, output))
            if row_banned:
                banned[i] = row_banned
        return banned

    def _first_free_row(self) -> int:
        for row in range(self._num_rows):
            if self.req_ids[row] is None:
                return row
        if self._num_rows >= self.max_num_reqs:
            raise ValueError(f"the batch already holds max_num_reqs={self.max_num_reqs} requests")
        return self._num_rows

    def _set_sampling_params(
        self, row: int, params: SamplingParams, generator: torch.Generator | None
    ) -> None:
        self._rows_version += 1
        self.sampling_params[row] = params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        if generator is not None:
            self.generators[row] = generator

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None and self.req_ids[dst] is None
        self._rows_version += 1
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_row[req_id] = dst
        num_tokens = int(self.num_tokens[src])
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
        ):
            array[dst] = array[src]
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        generator = self.generators.pop(src, None)
        if generator is not None:
            self.generators[dst] = generator
        self.block_table.move_row(src, dst)
        self.block_table.clear_row(src)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _depends_on_history(params: SamplingParams | None) -> bool:
    """Whether a row's sampling metadata changes as its history grows."""
    return params is not None and bool(
        params.has_penalties or params.min_tokens or params.bad_words_token_ids
    )


def _bad_word_endings(bad_words: list[list[int]], output: np.ndarray) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (as vLLM: a
    one-token bad word is always banned)."""
    endings = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (
            not prefix or output[len(output) - len(prefix) :].tolist() == prefix
        ):
            endings.append(word[-1])
    return endings
