"""One scheduler step on one device: diff -> persistent batch -> model inputs -> forward -> sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from core_engine.common.kv_cache_groups import KVCacheGroup
from core_engine.common.math_utils import cdiv, concatenated_ranges
from core_engine.kernels import AttentionMetadata
from core_engine.proto import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from core_engine.worker.decode_graphs import DecodeGraphs, GraphCapture
from core_engine.worker.input_batch import CachedRequestState, InputBatch
from core_engine.worker.sample.rejection_sampler import RejectionSampler
from core_engine.worker.sample.sampler import Sampler, SamplingMetadata
from core_engine.worker.step_transfer import StepTransfer
from core_engine.worker.structured_outputs import StructuredOutputManager

if TYPE_CHECKING:
    from core_engine.worker.lora.lora_manager import LoRAManager

# Prompt positions whose logits are computed at once for prompt logprobs (a bound on the
# [rows, vocab] float32 tensor a long prompt would otherwise need in one piece).
PROMPT_LOGPROBS_ROWS = 256
# How long a step with no tokens waits for a grammar still compiling before it answers: the
# engine core, whose only requests wait for their grammars, learns of one within this long of
# its compile ending, and spins at most this often meanwhile.
GRAMMAR_WAIT_S = 0.05


# One step's attention metadata: one for every layer, or (a model with several KV cache groups)
# one per layer, each its group's (block table and slot mapping; the rest is shared).
StepMetadata = AttentionMetadata | list[AttentionMetadata]


class CausalLM(Protocol):
    """What the runner needs from a model. `forward` writes K/V through `metadata.slot_mapping`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: StepMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class StepInputs:
    """Device inputs of one forward pass over T scheduled tokens of B batch rows.

    `sample_rows` (host, ascending) are the batch rows whose scheduled range reaches the end of
    their tokens (and of their drafts), so they sample this step. A sample row verifying K
    drafts has K + 1 entries in `logits_indices`, its last K + 1 scheduled tokens (the last
    token of its history, then its drafts but the last); any other sample row has one, its
    last scheduled token. Entries are in `sample_rows` order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    group_metadata: list[AttentionMetadata]  # one per KV cache group
    sample_rows: np.ndarray
    logits_indices: torch.Tensor
    num_scheduled: np.ndarray  # int64 [B]: tokens of each row this step
    num_draft_tokens: np.ndarray  # int64 [B]: drafts each row verifies this step
    verifies_drafts: bool  # whether any row does
    first_token: np.ndarray  # int64 [B]: index of each row's first token among the T


class ModelRunner:
    """Holds the per-request state and the persistent batch of one worker, and runs steps.

    Contract: `execute_model` accepts the `SchedulerOutput` diffs of one scheduler in order.
    Every request the scheduler lists as cached must have arrived as new before and not be
    finished. A request held but not scheduled this step (preempted or skipped) leaves the batch
    and keeps its state until it comes back or is listed in `finished_req_ids`. A constrained
    request's grammar is compiled from `grammars_to_prepare`, before the request is scheduled; a
    step reports the compiles that ended (see `worker.structured_outputs`).

    `async_scheduling`: the tokens a step samples join their requests' history here at once,
    since the next step (planned before they reached the scheduler) already computes them; the
    scheduler then never sends them back in `CachedRequestData.new_token_ids`.

    After `capture_decode_graphs`, decode steps without LoRA replay CUDA graphs (see
    `worker.decode_graphs`); the graphs read the KV caches given to `initialize_kv_cache` before
    the capture, so a new cache needs a new runner.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        structured_outputs: StructuredOutputManager | None = None,
        kv_cache_groups: Sequence[KVCacheGroup] = (),
        lora_manager: LoRAManager | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.model = model
        self.async_scheduling = async_scheduling
        self.lora_manager = lora_manager
        self.structured_outputs = structured_outputs
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        # Layer i reads the block table of group layer_to_group[i] (no groups: one for all).
        self.layer_to_group = _layer_to_group(kv_cache_groups)
        self.input_batch = InputBatch(
            max_num_reqs,
            max_model_len,
            block_size,
            device,
            eos_token_ids=eos_token_ids,
            num_kv_cache_groups=max(len(kv_cache_groups), 1),
        )
        self.sampler = Sampler(device, seed=seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self._arange = np.arange(max(max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)
        self.step_transfer = StepTransfer(device)  # the step's inputs in one copy
        self.decode_graphs: DecodeGraphs | None = None

    def initialize_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        self.kv_caches = kv_caches

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: Sequence[int], capture: GraphCapture) -> DecodeGraphs:
        """Captures the decode forward over the KV caches for each padded batch size in
        `sizes` (at most max_num_reqs); from now on decode steps replay them."""
        if not self.kv_caches:
            raise RuntimeError("capture_decode_graphs called before initialize_kv_cache")
        if max(sizes) > self.max_num_reqs:
            raise ValueError(
                f"a CUDA graph of {max(sizes)} requests is larger than max_num_reqs="
                f"{self.max_num_reqs}"
            )
        graphs = DecodeGraphs(
            sizes,
            device=self.device,
            block_tables=[
                table.device_table for table in self.input_batch.block_table.block_tables
            ],
            max_model_len=self.max_model_len,
        )

        def forward(input_ids, positions, group_metadata):
            metadata = self._step_metadata(group_metadata)
            return self.model.forward(input_ids, positions, self.kv_caches, metadata)

        graphs.capture_all(forward, capture)
        self.decode_graphs = graphs
        return graphs

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step; returns one entry per scheduled request, in batch row order."""
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._report_compiled_grammars(ModelRunnerOutput(), wait_s=GRAMMAR_WAIT_S)
        if not self.kv_caches:
            raise RuntimeError("execute_model called before initialize_kv_cache")
        inputs = self._prepare_inputs(scheduler_output)
        hidden_states = self._forward(inputs)
        output = self._sample(hidden_states, inputs)
        output.prompt_logprobs = self._prompt_logprobs(hidden_states, inputs)
        if self.async_scheduling:
            self._append_sampled_tokens(output)
        return self._report_compiled_grammars(output)

    def _append_sampled_tokens(self, output: ModelRunnerOutput) -> None:
        """Async scheduling: each sampled token joins its request's history now (a request
        the step failed gets none: it is finished)."""
        batch = self.input_batch
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids, strict=True):
            if token_ids and req_id not in output.request_errors:
                state = self.requests[req_id]
                self._append_token_ids(state, batch.req_id_to_row[req_id], token_ids)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's forward over the step's tokens, each through its request's adapter; a
        decode step a captured graph covers replays it."""
        if self._can_replay_graph(inputs):
            return self.decode_graphs.run(
                inputs.input_ids,
                inputs.positions,
                [metadata.slot_mapping for metadata in inputs.group_metadata],
                inputs.group_metadata[0].seq_lens,
            )
        metadata = self._step_metadata(inputs.group_metadata)
        if self.lora_manager is None:
            return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, metadata)
        batch = self.input_batch
        row_adapters = [self.requests[r].lora_request for r in batch.req_ids[: batch.num_reqs]]
        self.lora_manager.set_step(row_adapters, inputs.num_scheduled)
        try:
            return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, metadata)
        finally:
            self.lora_manager.clear_step()

    def _can_replay_graph(self, inputs: StepInputs) -> bool:
        return (
            self.decode_graphs is not None
            and self.lora_manager is None
            and self.decode_graphs.can_run(
                num_reqs=self.input_batch.num_reqs,
                num_tokens=inputs.input_ids.shape[0],
                max_query_len=inputs.group_metadata[0].max_query_len,
            )
        )

    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int, kv_caches: list[torch.Tensor]) -> None:
        """A forward of `num_tokens` prompt tokens (as prompts of up to max_model_len tokens)
        plus sampling of min(max_num_reqs, num_tokens) rows, writing into the scratch
        `kv_caches`, which must hold `sum(ceil(prompt_len / block_size))` blocks.
        Used to measure peak activation memory; touches no request state."""
        seq_len = min(num_tokens, self.max_model_len)
        seq_lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            seq_lens.append(num_tokens % seq_len)
        positions, metadata = self._dummy_prompt_metadata(
            seq_lens, block_size=kv_caches[0].shape[2]
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden_states = self.model.forward(input_ids, positions, kv_caches, metadata)
        num_rows = min(self.max_num_reqs, num_tokens)
        logits = self.model.compute_logits(hidden_states[:num_rows])
        self.sampler(logits, self._dummy_sampling_metadata(num_rows))

    def _dummy_prompt_metadata(
        self, seq_lens: list[int], block_size: int
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of whole prompts of `seq_lens` tokens in consecutive blocks."""
        num_blocks = [cdiv(n, block_size) for n in seq_lens]
        block_table = np.zeros((len(seq_lens), max(num_blocks)), dtype=np.int32)
        first_blocks = np.cumsum([0, *num_blocks])
        for row, n in enumerate(num_blocks):
            block_table[row, :n] = np.arange(first_blocks[row], first_blocks[row] + n)
        positions = np.concatenate([self._arange[:n] for n in seq_lens])
        req_rows = np.repeat(np.arange(len(seq_lens)), seq_lens)
        block_ids = block_table[req_rows, positions // block_size].astype(np.int64)
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(block_ids * block_size + positions % block_size),
            block_table=self._to_device(block_table),
            seq_lens=self._to_device(np.array(seq_lens, dtype=np.int32)),
            query_start_loc=self._to_device(np.cumsum([0, *seq_lens]).astype(np.int32)),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
        )
        return self._to_device(positions), metadata

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            if self.structured_outputs is not None:
                self.structured_outputs.remove_request(req_id)
        for req_id, constraint in scheduler_output.grammars_to_prepare.items():
            self._structured_outputs().add_request(req_id, constraint)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in list(batch.req_id_to_row):
            if req_id not in scheduled:
                batch.remove_request(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            self._add_new_request(new_req)
        for cached_req in scheduler_output.scheduled_cached_reqs:
            self._update_cached_request(cached_req)
        batch.condense()
        batch.set_draft_token_ids(scheduler_output.scheduled_spec_decode_tokens)

    def _add_new_request(self, new_req: NewRequestData) -> None:
        """A new request replaces any state still held under its id."""
        if new_req.req_id in self.requests:
            self.input_batch.remove_request(new_req.req_id)
        state = CachedRequestState(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            sampling_params=new_req.sampling_params,
            block_ids=[list(group_block_ids) for group_block_ids in new_req.block_ids],
            num_computed_tokens=new_req.num_computed_tokens,
            generator=self._make_generator(new_req.sampling_params.seed),
            lora_request=new_req.lora_request,
        )
        self.requests[new_req.req_id] = state
        self.input_batch.add_request(state)
        constraint = new_req.sampling_params.structured_outputs
        # Normally prepared (and compiled) before the request was scheduled: keep that grammar.
        if constraint is not None and new_req.req_id not in self._structured_outputs().requests:
            self._structured_outputs().add_request(new_req.req_id, constraint)

    def _update_cached_request(self, cached_req: CachedRequestData) -> None:
        state = self.requests.get(cached_req.req_id)
        if state is None:
            raise ValueError(
                f"request {cached_req.req_id!r} was scheduled as cached but this worker never "
                "received it as new (or it already finished)"
            )
        state.num_computed_tokens = cached_req.num_computed_tokens
        batch = self.input_batch
        row = batch.req_id_to_row.get(cached_req.req_id)
        self._append_token_ids(state, row, cached_req.new_token_ids)
        if cached_req.resumed_from_preemption:
            state.block_ids = [
                list(group_block_ids) for group_block_ids in cached_req.new_block_ids
            ]
        elif cached_req.new_block_ids:  # no lists at all: no group has new blocks
            for held, new in zip(state.block_ids, cached_req.new_block_ids, strict=True):
                held.extend(new)

        if row is None:
            batch.add_request(state)
            return
        batch.num_computed_tokens[row] = cached_req.num_computed_tokens
        if cached_req.resumed_from_preemption:
            batch.block_table.add_row(cached_req.new_block_ids, row)
        else:
            batch.block_table.append_row(cached_req.new_block_ids, row)

    def _append_token_ids(
        self, state: CachedRequestState, row: int | None, token_ids: list[int]
    ) -> None:
        """Extends a request's history (and its batch row, `row` None: not in the batch) and
        advances its grammar."""
        if not token_ids:
            return
        state.output_token_ids.extend(token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs.accept_tokens(state.req_id, token_ids)
        if row is not None:
            self.input_batch.append_token_ids(row, token_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids[:num_reqs]],
            dtype=np.int64,
        )
        self._check_token_count(int(num_scheduled.sum()), scheduler_output)
        cu_num_scheduled = np.cumsum(num_scheduled)
        req_rows, positions = self._token_rows_and_positions(num_scheduled, cu_num_scheduled)
        seq_lens = batch.num_computed_tokens[:num_reqs] + num_scheduled
        num_drafts = batch.num_draft_tokens[:num_reqs].astype(np.int64)
        num_tokens_with_drafts = batch.num_tokens[:num_reqs] + num_drafts
        self._check_scheduled_tokens_exist(seq_lens, num_tokens_with_drafts)
        self._check_drafts_are_verified(seq_lens, num_tokens_with_drafts, num_scheduled)
        sample_rows = np.flatnonzero((seq_lens == num_tokens_with_drafts) & (num_scheduled > 0))
        if batch.has_draft_tokens:
            num_verified = num_drafts[sample_rows] + 1
            logits_indices = np.repeat(cu_num_scheduled[sample_rows] - num_verified, num_verified)
            logits_indices += concatenated_ranges(num_verified)
        else:
            logits_indices = cu_num_scheduled[sample_rows] - 1
        tables = batch.block_table.block_tables
        (
            input_ids,
            positions_device,
            logits_indices_device,
            seq_lens_device,
            query_start_loc,
            *slot_mappings,
        ) = self.step_transfer.send(
            [
                batch.token_ids[req_rows, positions].astype(np.int64),
                positions,
                logits_indices,
                seq_lens.astype(np.int32),
                np.concatenate([[0], cu_num_scheduled]).astype(np.int32),
                *(table.compute_slot_mapping(req_rows, positions) for table in tables),
            ]
        )
        group_metadata = [
            AttentionMetadata(
                slot_mapping=slot_mapping,
                block_table=table.commit(num_reqs),
                seq_lens=seq_lens_device,
                query_start_loc=query_start_loc,
                max_query_len=int(num_scheduled.max()),
                max_seq_len=int(seq_lens.max()),
            )
            for table, slot_mapping in zip(tables, slot_mappings, strict=True)
        ]
        return StepInputs(
            input_ids=input_ids,
            positions=positions_device,
            group_metadata=group_metadata,
            sample_rows=sample_rows,
            logits_indices=logits_indices_device,
            num_scheduled=num_scheduled,
            num_draft_tokens=num_drafts,
            verifies_drafts=batch.has_draft_tokens,
            first_token=cu_num_scheduled - num_scheduled,
        )

    def _step_metadata(self, group_metadata: list[AttentionMetadata]) -> StepMetadata:
        """The metadata the model takes: the one group's, or each layer's group's."""
        if len(group_metadata) == 1:
            return group_metadata[0]
        return [group_metadata[group] for group in self.layer_to_group]

    def _token_rows_and_positions(
        self, num_scheduled: np.ndarray, cu_num_scheduled: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Batch row and position of each scheduled token: row r contributes positions
        `num_computed[r] .. num_computed[r] + num_scheduled[r] - 1`, rows in order."""
        num_tokens = int(cu_num_scheduled[-1])
        req_rows = np.repeat(self._arange[: len(num_scheduled)], num_scheduled)
        first_token_of_row = np.repeat(cu_num_scheduled - num_scheduled, num_scheduled)
        offsets = self._arange[:num_tokens] - first_token_of_row
        num_computed = self.input_batch.num_computed_tokens[: len(num_scheduled)]
        return req_rows, num_computed[req_rows].astype(np.int64) + offsets

    def _sample(self, hidden_states: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """Samples every sample row, verifying its drafts if it has any: one logits row per
        verified position, each with the sampling metadata and grammar mask of the history
        extended by the drafts before it."""
        batch = self.input_batch
        req_ids = [r for r in batch.req_ids[: batch.num_reqs] if r is not None]
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        if len(inputs.sample_rows) == 0:
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids)
        logits = self.model.compute_logits(self._logits_rows(hidden_states, inputs))
        sample_rows = inputs.sample_rows.tolist()
        metadata, draft_token_ids = self._verified_positions(inputs, sample_rows)
        request_errors = {}
        if self.structured_outputs is not None and self.structured_outputs.requests:
            request_errors = self.structured_outputs.mask_logits(
                logits, [batch.req_ids[row] for row in sample_rows], draft_token_ids
            )
        output = self.rejection_sampler(logits, metadata, draft_token_ids)
        logprobs: list | None = None
        if any(entries is not None for entries in output.logprobs):
            logprobs = [None] * len(req_ids)
        for i, row in enumerate(sample_rows):
            sampled_token_ids[row] = output.token_ids[i]
            if logprobs is not None:
                logprobs[row] = output.logprobs[i]
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            request_errors=request_errors,
        )

    def _verified_positions(
        self, inputs: StepInputs, sample_rows: list[int]
    ) -> tuple[SamplingMetadata, list[list[int]]]:
        """The sampling metadata of every position the sample rows verify (their last token,
        then each draft but the last), and each sample row's drafts."""
        batch = self.input_batch
        if not inputs.verifies_drafts:
            return batch.sampling_metadata(inputs.sample_rows), [[]] * len(sample_rows)
        num_verified = inputs.num_draft_tokens[inputs.sample_rows] + 1
        metadata = batch.sampling_metadata(
            np.repeat(inputs.sample_rows, num_verified),
            num_draft_prefix=concatenated_ranges(num_verified),
        )
        return metadata, [batch.draft_token_ids(row) for row in sample_rows]

    @staticmethod
    def _logits_rows(hidden_states: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of the rows the LM head runs over. `logits_indices` ascend
        strictly within [0, T), so as many of them as tokens is every token in order (a decode
        step without drafts): the states as they are, without a gather."""
        if inputs.logits_indices.shape[0] == hidden_states.shape[0]:
            return hidden_states
        return hidden_states[inputs.logits_indices]

    def _report_compiled_grammars(
        self, output: ModelRunnerOutput, wait_s: float = 0.0
    ) -> ModelRunnerOutput:
        """`output` with the grammars whose compile ended since the last report: compiled ones
        in `grammars_ready`, failed ones in `request_errors`. Waits up to `wait_s` for one when
        any is still compiling."""
        manager = self.structured_outputs
        if manager is None or not manager.has_compiles_to_report:
            return output
        if wait_s > 0:
            manager.wait_for_compile(wait_s)
        output.grammars_ready, errors = manager.take_compiled()
        output.request_errors.update(errors)
        return output

    def _prompt_logprobs(
        self, hidden_states: torch.Tensor, inputs: StepInputs
    ) -> dict[str, list[TokenLogprobs]]:
        """For each request that asked, the logprobs of the prompt tokens this step's chunk
        predicts: scheduled position p predicts prompt token p + 1. The LM head runs over those
        positions only, PROMPT_LOGPROBS_ROWS at a time."""
        batch = self.input_batch
        result: dict[str, list[TokenLogprobs]] = {}
        for row in range(batch.num_reqs):
            params = batch.sampling_params[row]
            if params is None or params.prompt_logprobs is None:
                continue
            first = int(batch.num_computed_tokens[row])
            num_prompt = int(batch.num_prompt_tokens[row])
            count = min(first + int(inputs.num_scheduled[row]), num_prompt - 1) - first
            if count <= 0:
                continue
            rows = int(inputs.first_token[row]) + np.arange(count)
            targets = batch.token_ids[row, first + 1 : first + 1 + count].astype(np.int64)
            result[batch.req_ids[row]] = self._token_logprobs(
                hidden_states, rows, targets, params.prompt_logprobs
            )
        return result

    def _token_logprobs(
        self, hidden_states: torch.Tensor, rows: np.ndarray, targets: np.ndarray, num_top: int
    ) -> list[TokenLogprobs]:
        out: list[TokenLogprobs] = []
        for start in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            chunk = slice(start, start + PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(hidden_states[self._to_device(rows[chunk])])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target_ids = self._to_device(targets[chunk])[:, None]
            target_logprobs = logprobs.gather(-1, target_ids)
            ranks = ((logprobs > target_logprobs).sum(dim=-1) + 1).tolist()
            top_logprobs, top_ids = (
                logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], target_ids[:, :0])
            )
            for i, value in enumerate(target_logprobs[:, 0].tolist()):
                out.append(
                    TokenLogprobs(
                        sampled_logprob=value,
                        sampled_rank=ranks[i],
                        top_token_ids=top_ids[i].tolist(),
                        top_logprobs=top_logprobs[i].tolist(),
                    )
                )
        return out

    def _check_token_count(self, num_tokens: int, scheduler_output: SchedulerOutput) -> None:
        expected = scheduler_output.total_num_scheduled_tokens
        if num_tokens != expected:
            raise ValueError(
                f"scheduler output lists {num_tokens} tokens per request but "
                f"total_num_scheduled_tokens={expected}"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"step schedules {num_tokens} tokens, more than "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )

    def _check_scheduled_tokens_exist(self, seq_lens: np.ndarray, num_tokens: np.ndarray) -> None:
        beyond = np.flatnonzero(seq_lens > num_tokens)
        if len(beyond):
            row = int(beyond[0])
            raise ValueError(
                f"request {self.input_batch.req_ids[row]!r} is scheduled up to token "
                f"{int(seq_lens[row])} but holds only {int(num_tokens[row])} tokens"
            )

    def _check_drafts_are_verified(
        self, seq_lens: np.ndarray, num_tokens_with_drafts: np.ndarray, num_scheduled: np.ndarray
    ) -> None:
        """A request with K drafts must be scheduled through its last draft, from at most its
        last history token on: its K + 1 verified positions all run this step."""
        num_drafts = self.input_batch.num_draft_tokens[: len(seq_lens)]
        bad = np.flatnonzero(
            (num_drafts > 0)
            & ((seq_lens != num_tokens_with_drafts) | (num_scheduled < num_drafts + 1))
        )
        if len(bad):
            row = int(bad[0])
            raise ValueError(
                f"request {self.input_batch.req_ids[row]!r} verifies {int(num_drafts[row])} "
                f"drafts, so it must be scheduled for at least {int(num_drafts[row]) + 1} tokens "
                f"ending at token {int(num_tokens_with_drafts[row])}; it is scheduled for "
                f"{int(num_scheduled[row])} ending at token {int(seq_lens[row])}"
            )

    def _structured_outputs(self) -> StructuredOutputManager:
        if self.structured_outputs is None:
            raise ValueError(
                "a request asks for structured outputs, but this worker was built without a "
                "StructuredOutputManager"
            )
        return self.structured_outputs

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _dummy_sampling_metadata(self, num_rows: int) -> SamplingMetadata:
        ones = torch.ones(num_rows, device=self.device)
        return SamplingMetadata(
            temperature=ones,
            top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=self.device),
            top_p=ones * 0.9,
            min_p=ones * 0.05,
            num_logprobs=[None] * num_rows,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)


def _layer_to_group(kv_cache_groups: Sequence[KVCacheGroup]) -> list[int]:
    """Per layer, the index of its KV cache group; empty without groups."""
    layer_to_group: dict[int, int] = {}
    for group_index, group in enumerate(kv_cache_groups):
        for layer_index in group.layer_indices:
            layer_to_group[layer_index] = group_index
    return [layer_to_group[layer] for layer in range(len(layer_to_group))]
