"""`NullWorker`: the `Worker` API with no model and no torch, for tests and IPC benchmarks.

It tracks just enough per-request state to know when a request has finished its prompt, and then
samples `NULL_TOKEN_ID` once per step. It never samples an eos token, so requests stop on
`max_tokens`, `max_model_len`, `stop_token_ids` or abort. With draft tokens it is a greedy
verifier whose target is always `NULL_TOKEN_ID`: it accepts the leading drafts equal to it, then
samples it once more, so speculation never changes its output.
"""

from __future__ import annotations

from dataclasses import dataclass

from core_engine.common.math_utils import cdiv
from core_engine.proto import ModelRunnerOutput, SchedulerOutput, TokenLogprobs, WorkerReady
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.lora_request import LoRATargetShapes

NULL_TOKEN_ID = 42
NULL_VOCAB_SIZE = 32000
NULL_MAX_MODEL_LEN = 4096
NULL_MAX_NUM_BATCHED_TOKENS = 2048
NULL_ALTERNATIVE_LOGPROB = -30.0
# The null model's KV cache costs no memory, but the core's block pool keeps one Python object
# per block: past this many (16M tokens at block size 16) start-up would take minutes.
NULL_MAX_NUM_BLOCKS = 1 << 20


@dataclass(slots=True)
class NullRequestState:
    """Invariant: `num_tokens` counts the prompt plus every token the scheduler sent back
    (under async scheduling: every token sampled here, which the scheduler never sends)."""

    num_tokens: int
    num_logprobs: int | None


class NullWorker:
    """A `WorkerProtocol` whose every step is instant (built from the config and its rank)."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.device = "cpu" if config.device == "auto" else config.device
        self.rank = rank
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or NULL_MAX_MODEL_LEN
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.step_token_budget(
            NULL_MAX_NUM_BATCHED_TOKENS, self.max_model_len
        )
        self.vocab_size = NULL_VOCAB_SIZE
        self.layer_sliding_windows: list[int | None] = []
        self.eos_token_ids: list[int] = []
        self.num_gpu_blocks: int | None = None
        self.req_id_to_state: dict[str, NullRequestState] = {}
        self.async_scheduling = config.async_scheduling
        # No KV, so no KV connector (EngineConfig refuses one for the null model).
        self.kv_connector_handshake = None
        # No linears: with enable_lora, an adapter can target nothing here.
        self.lora_target_shapes = (
            LoRATargetShapes(0, {}, config.max_lora_rank) if config.enable_lora else None
        )

    def describe(self, ready: WorkerReady, load_s: float) -> str:
        return f"worker rank {ready.rank}: null model on {ready.device}, {ready.num_gpu_blocks} KV blocks"

    def load_model(self) -> None:
        """Nothing to load."""

    def determine_num_available_blocks(self) -> int:
        """Enough blocks for every sequence at full length plus the null block, up to
        NULL_MAX_NUM_BLOCKS (a max_model_len beyond that is the core's clear start-up error)."""
        num_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        return min(self.max_num_seqs * num_blocks_per_seq + 1, NULL_MAX_NUM_BLOCKS)

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One sample per scheduled request whose computed tokens reach its known tokens."""
        for req_id in scheduler_output.finished_req_ids:
            self.req_id_to_state.pop(req_id, None)
        for new_req in scheduler_output.scheduled_new_reqs:
            self.req_id_to_state[new_req.req_id] = NullRequestState(
                len(new_req.prompt_token_ids), new_req.sampling_params.logprobs
            )
        req_id_to_num_computed = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        for cached_req in scheduler_output.scheduled_cached_reqs:
            self.req_id_to_state[cached_req.req_id].num_tokens += len(cached_req.new_token_ids)
            req_id_to_num_computed[cached_req.req_id] = cached_req.num_computed_tokens

        output = ModelRunnerOutput()
        # A constrained request is scheduled only once its grammar is ready: refuse it now.
        for req_id in scheduler_output.grammars_to_prepare:
            output.request_errors[req_id] = (
                "structured_outputs: the null model has no vocabulary to constrain"
            )
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.sampling_params.prompt_logprobs is not None:
                output.request_errors[new_req.req_id] = (
                    "prompt_logprobs: the null model computes no logits"
                )
        any_logprobs = False
        logprobs: list[list[TokenLogprobs] | None] = []
        for req_id, num_computed in req_id_to_num_computed.items():
            state = self.req_id_to_state[req_id]
            done_prompt = (
                num_computed + scheduler_output.num_scheduled_tokens[req_id] >= state.num_tokens
            )
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            sampled = _verify_null_drafts(drafts) if done_prompt else []
            output.req_ids.append(req_id)
            output.sampled_token_ids.append(sampled)
            if self.async_scheduling:
                state.num_tokens += len(sampled)
            wants_logprobs = done_prompt and state.num_logprobs is not None
            any_logprobs |= wants_logprobs
            logprobs.append(
                [_null_logprobs(state.num_logprobs)] * len(sampled) if wants_logprobs else None
            )
        if any_logprobs:
            output.logprobs = logprobs
        return output


def _verify_null_drafts(draft_token_ids: list[int]) -> list[int]:
    """The leading drafts equal to NULL_TOKEN_ID, then NULL_TOKEN_ID."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == NULL_TOKEN_ID:
        num_accepted += 1
    return [NULL_TOKEN_ID] * (num_accepted + 1)


def _null_logprobs(num_logprobs: int) -> TokenLogprobs:
    """The fixed token has probability 1; its alternatives are the next token ids."""
    top_token_ids = [NULL_TOKEN_ID + i for i in range(num_logprobs)]
    top_logprobs = [0.0 if i == 0 else NULL_ALTERNATIVE_LOGPROB for i in range(num_logprobs)]
    return TokenLogprobs(0.0, 1, top_token_ids, top_logprobs)
