"""Structured outputs under speculative decoding: each verified position is masked by the
grammar's state after the drafts before it, a draft the grammar refuses is rejected where it
stands, and the matcher ends each step where the scheduler's tokens put it.

The vocabulary is the test tokenizer's (one token per byte after three specials), so grammars
compile in well under a second."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from core_engine.common.grammars import build_grammar, xgrammar
from core_engine.proto import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from core_engine.proto.sampling_params import StructuredOutputs
from core_engine.worker.model_runner import ModelRunner
from core_engine.worker.structured_outputs import StructuredOutputManager
from tests.helpers.model_fixtures import write_byte_level_tokenizer

VOCAB_SIZE = 320
EOS_TOKEN_ID = 0  # <|endoftext|>
PATTERN = r"\d{3}-\d{2}"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_tokenizer")
    write_byte_level_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def token_id(tokenizer_folder):
    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))

    def encode(char: str) -> int:
        (single,) = tokenizer.encode(char, add_special_tokens=False).ids
        return single

    return encode


def make_manager(folder) -> StructuredOutputManager:
    return StructuredOutputManager(folder, VOCAB_SIZE, [EOS_TOKEN_ID])


def fresh_allowed(manager, token_ids: list[int]) -> set[int]:
    """The tokens a new matcher of PATTERN allows after `token_ids`."""
    compiled = manager._compiled(StructuredOutputs(regex=PATTERN)).result()
    matcher = xgrammar().GrammarMatcher(compiled)
    for token in token_ids:
        assert matcher.accept_token(token)
    return allowed_by(matcher)


def allowed_by(matcher) -> set[int]:
    xgr = xgrammar()
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB_SIZE)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB_SIZE)
    return set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())


def finite_tokens(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero()[:, 0].tolist())


def test_each_draft_row_is_masked_by_the_state_after_the_drafts_before_it(
    tokenizer_folder, token_id
):
    assert build_grammar(regex=PATTERN) is not None
    manager = make_manager(tokenizer_folder)
    manager.add_request("r", StructuredOutputs(regex=PATTERN))
    manager.accept_tokens("r", [token_id("1")])
    seven, dash, letter = token_id("7"), token_id("-"), token_id("a")
    drafts = [seven, seven, letter, dash]  # "1" + "77" is fine, then "a" breaks the grammar
    logits = torch.zeros(2 + len(drafts), VOCAB_SIZE)  # a free request's row, then 5 rows
    errors = manager.mask_logits(logits, ["free", "r"], [[], drafts])
    assert errors == {}
    assert finite_tokens(logits[0]) == set(range(VOCAB_SIZE))
    history = [token_id("1")]
    for j in range(3):  # rows after "1", "17", "177": the last allows only "-"
        assert finite_tokens(logits[1 + j]) == fresh_allowed(manager, history + drafts[:j]), j
    assert finite_tokens(logits[3]) == {dash}
    # The row after the refused "a" is never used (the draft is rejected at its own row).
    assert finite_tokens(logits[4]) == set(range(VOCAB_SIZE))
    assert finite_tokens(logits[5]) == set(range(VOCAB_SIZE))
    # The matcher is back where it began: after "1".
    assert allowed_by(manager.requests["r"].matcher) == fresh_allowed(manager, history)


class FixedLogitsModel:
    """A stand-in model whose every position has the same logits: "a" best, then "7", then
    "-", the rest 0 (so its greedy choice is always the best token the grammar allows)."""

    num_layers = 0

    def __init__(self, token_id) -> None:
        self.logits = torch.zeros(VOCAB_SIZE)
        self.logits[token_id("a")], self.logits[token_id("7")] = 5.0, 4.0
        self.logits[token_id("-")] = 1.0

    def forward(self, input_ids, positions, kv_caches, metadata):
        return torch.zeros(len(input_ids), 1)

    def compute_logits(self, hidden_states):
        return self.logits.expand(len(hidden_states), -1).clone()


def test_drafts_that_break_the_grammar_are_rejected_there_and_the_matcher_follows_the_tokens(
    tokenizer_folder, token_id
):
    manager = make_manager(tokenizer_folder)
    runner = ModelRunner(
        FixedLogitsModel(token_id),
        device=torch.device("cpu"),
        block_size=4,
        max_model_len=32,
        max_num_reqs=2,
        max_num_batched_tokens=32,
        eos_token_ids=[EOS_TOKEN_ID],
        structured_outputs=manager,
    )
    runner.initialize_kv_cache([torch.zeros(1)])
    seven, dash, letter = token_id("7"), token_id("-"), token_id("a")
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, structured_outputs=StructuredOutputs(regex=PATTERN)
    )
    prompt = [token_id("x"), token_id("y")]
    first = runner.execute_model(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("r", prompt, params, [[1, 2, 3]], 0)],
            num_scheduled_tokens={"r": 2},
            total_num_scheduled_tokens=2,
        )
    )
    assert first.sampled_token_ids == [[seven]]
    sent_back: list[int] = []
    steps = [
        ([seven, seven, letter, dash], [seven, seven, dash]),  # "a" refused: "-" there instead
        ([dash, seven], [seven]),  # after "777-" a digit: the first draft is refused
        ([seven, seven], [seven, EOS_TOKEN_ID]),  # "777-77" is complete: only eos is left
        ([letter], [letter, letter]),  # past eos (ignore_eos) nothing is left to constrain
    ]
    new_token_ids = [seven]
    for drafts, expected in steps:
        sent_back += new_token_ids
        num_computed = len(prompt) + len(sent_back) - 1
        output = runner.execute_model(
            SchedulerOutput(
                scheduled_cached_reqs=[
                    CachedRequestData("r", num_computed, new_token_ids=new_token_ids)
                ],
                num_scheduled_tokens={"r": 1 + len(drafts)},
                total_num_scheduled_tokens=1 + len(drafts),
                scheduled_spec_decode_tokens={"r": drafts},
            )
        )
        assert output.sampled_token_ids == [expected], drafts
        # The matcher holds the tokens sent back, not this step's drafts or returned tokens.
        matcher = manager.requests["r"].matcher
        if EOS_TOKEN_ID in sent_back:
            assert matcher.is_terminated()
        else:
            assert allowed_by(matcher) == fresh_allowed(manager, sent_back)
        new_token_ids = expected
