"""InputBatch: rows added into holes, removed, condensed with all their state."""

import numpy as np
import pytest
import torch

from core_engine.proto import SamplingParams
from core_engine.worker.input_batch import CachedRequestState, InputBatch

CPU = torch.device("cpu")


def make_batch(max_num_reqs: int = 4, max_model_len: int = 16, eos: tuple = (2,)) -> InputBatch:
    return InputBatch(max_num_reqs, max_model_len, block_size=4, device=CPU, eos_token_ids=eos)


def make_state(
    req_id: str, prompt: list[int], block_ids: list[int], **params
) -> CachedRequestState:
    generator = None
    if params.get("seed") is not None:
        generator = torch.Generator().manual_seed(params["seed"])
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        block_ids=[block_ids],  # one KV cache group
        num_computed_tokens=0,
        generator=generator,
    )


def test_add_fills_rows_in_order_and_records_tokens():
    batch = make_batch()
    assert batch.add_request(make_state("a", [5, 6, 7], [1])) == 0
    assert batch.add_request(make_state("b", [8], [2])) == 1
    assert batch.num_reqs == 2
    assert batch.token_ids[0, :3].tolist() == [5, 6, 7]
    assert batch.num_tokens[:2].tolist() == [3, 1]
    assert batch.num_prompt_tokens[:2].tolist() == [3, 1]


def test_add_restores_output_tokens_of_a_known_request():
    batch = make_batch()
    state = make_state("a", [5, 6], [1])
    state.output_token_ids = [9, 10]
    row = batch.add_request(state)
    assert batch.token_ids[row, :4].tolist() == [5, 6, 9, 10]
    assert batch.num_prompt_tokens[row] == 2


def test_remove_leaves_hole_that_next_add_fills():
    batch = make_batch()
    for name in "abc":
        batch.add_request(make_state(name, [1], [1]))
    assert batch.remove_request("b") == 1
    assert batch.req_ids[:3] == ["a", None, "c"]
    assert batch.remove_request("missing") is None
    assert batch.add_request(make_state("d", [1], [1])) == 1


def test_condense_moves_last_rows_into_holes_with_all_state():
    batch = make_batch()
    batch.add_request(make_state("a", [1, 1], [1]))
    batch.add_request(make_state("b", [2], [2]))
    batch.add_request(make_state("c", [3, 3, 3], [3, 4], temperature=0.5, top_k=7, seed=11))
    batch.add_request(make_state("d", [4], [5], top_p=0.5, min_p=0.1))
    batch.remove_request("a")
    batch.remove_request("b")
    batch.condense()

    assert batch.req_ids == ["d", "c", None, None]
    assert batch.req_id_to_row == {"d": 0, "c": 1}
    assert batch.token_ids[1, :3].tolist() == [3, 3, 3]
    assert batch.num_tokens[:2].tolist() == [1, 3]
    assert batch.block_table[0].block_table_np[1, :2].tolist() == [3, 4]
    assert batch.block_table[0].num_blocks_per_row.tolist() == [1, 2, 0, 0]
    assert batch.temperature[1] == pytest.approx(0.5) and batch.top_k[1] == 7
    assert batch.top_p[0] == pytest.approx(0.5) and batch.min_p[0] == pytest.approx(0.1)
    assert set(batch.generators) == {1}
    assert batch.add_request(make_state("e", [1], [1])) == 2


def test_condense_without_holes_is_a_no_op():
    batch = make_batch()
    batch.add_request(make_state("a", [1], [1]))
    batch.add_request(make_state("b", [2], [2]))
    batch.condense()
    assert batch.req_ids[:2] == ["a", "b"]


def test_append_past_max_model_len_raises():
    batch = make_batch(max_model_len=4)
    row = batch.add_request(make_state("a", [1, 2, 3], [1]))
    batch.append_token_ids(row, [4])
    with pytest.raises(ValueError, match="5 tokens, more than max_model_len=4"):
        batch.append_token_ids(row, [5])


def test_full_batch_raises():
    batch = make_batch(max_num_reqs=1)
    batch.add_request(make_state("a", [1], [1]))
    with pytest.raises(ValueError, match="max_num_reqs=1"):
        batch.add_request(make_state("b", [1], [1]))


def test_sampling_metadata_follows_requested_rows():
    batch = make_batch()
    batch.add_request(make_state("a", [1], [1], temperature=0.0))
    batch.add_request(make_state("b", [1], [1], temperature=0.7, top_k=3, seed=5, logprobs=2))
    meta = batch.sampling_metadata(np.array([1, 0]))
    assert meta.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert meta.top_k.tolist() == [3, 0]
    assert list(meta.generators) == [0]
    assert meta.num_logprobs == [2, None]


def test_stop_tokens_banned_until_min_tokens():
    batch = make_batch(eos=(2,))
    row = batch.add_request(make_state("a", [1], [1], min_tokens=2, stop_token_ids=[9]))
    batch.add_request(make_state("b", [1], [1], min_tokens=2, ignore_eos=True))
    meta = batch.sampling_metadata(np.array([row, 1]))
    assert meta.banned_token_ids == {0: [9, 2]}
    batch.append_token_ids(row, [4, 5])
    assert batch.sampling_metadata(np.array([row])).banned_token_ids == {}


def test_penalties_and_logit_bias_carry_each_rows_own_tokens():
    batch = make_batch()
    plain = batch.add_request(make_state("plain", [1, 2], [1]))
    row = batch.add_request(
        make_state("penalized", [3, 4, 4], [1], frequency_penalty=0.5, logit_bias={6: 2.0, 8: -1.0})
    )
    batch.append_token_ids(row, [9, 9])
    meta = batch.sampling_metadata(np.array([row, plain]))
    assert list(meta.penalties) == [0] and list(meta.logit_bias) == [0]
    penalty = meta.penalties[0]
    assert (penalty.presence, penalty.frequency, penalty.repetition) == (0.0, 0.5, 1.0)
    assert penalty.prompt_token_ids.tolist() == [3, 4, 4]
    assert penalty.output_token_ids.tolist() == [9, 9]
    assert meta.logit_bias[0] == ([6, 8], [2.0, -1.0])


def test_a_token_that_would_complete_a_bad_word_is_banned():
    batch = make_batch(max_model_len=32)
    row = batch.add_request(
        make_state("a", [1, 2], [1], bad_words_token_ids=[[7], [5, 6], [5, 8, 9]])
    )
    assert batch.sampling_metadata(np.array([row])).banned_token_ids == {0: [7]}
    batch.append_token_ids(row, [4, 5])
    assert batch.sampling_metadata(np.array([row])).banned_token_ids == {0: [7, 6]}
    batch.append_token_ids(row, [8])
    assert batch.sampling_metadata(np.array([row])).banned_token_ids == {0: [7, 9]}
    # The prompt does not count: only generated tokens can start a bad word.
    prompt_row = batch.add_request(make_state("b", [5], [2], bad_words_token_ids=[[5, 6]]))
    assert batch.sampling_metadata(np.array([prompt_row])).banned_token_ids == {}


def test_each_verified_position_sees_the_history_extended_by_the_drafts_before_it():
    """Row j of a request verifying drafts gets exactly the metadata of a request whose history
    already holds d_1..d_j: penalty counts, min_tokens' count, bad-word prefixes."""
    params = dict(
        frequency_penalty=0.5,
        presence_penalty=0.25,
        min_tokens=3,
        stop_token_ids=[9],
        bad_words_token_ids=[[5, 6], [6, 5, 7]],
    )
    prompt, output, drafts = [1, 2], [4], [5, 6, 5]
    spec = make_batch(max_model_len=32)
    row = spec.add_request(make_state("a", prompt, [1], **params))
    spec.append_token_ids(row, output)
    spec.set_draft_token_ids({"a": drafts})
    assert spec.draft_token_ids(row) == drafts and int(spec.num_tokens[row]) == 3
    verified = spec.sampling_metadata(np.array([row] * 4), num_draft_prefix=np.arange(4))
    for j in range(4):
        one_at_a_time = make_batch(max_model_len=32)
        plain_row = one_at_a_time.add_request(make_state("a", prompt, [1], **params))
        one_at_a_time.append_token_ids(plain_row, output + drafts[:j])
        expected = one_at_a_time.sampling_metadata(np.array([plain_row]))
        assert verified.banned_token_ids.get(j) == expected.banned_token_ids.get(0), j
        got, want = verified.penalties[j], expected.penalties[0]
        assert got.output_token_ids.tolist() == want.output_token_ids.tolist(), j
        assert got.prompt_token_ids.tolist() == want.prompt_token_ids.tolist() == prompt
    # Spot checks of what that means: min_tokens lifts its ban once d_2 makes 3 outputs; the
    # bad word [5, 6] is banned after d_1 = 5, [6, 5, 7] after d_2 d_3 = 6 5.
    assert verified.banned_token_ids == {0: [9, 2], 1: [9, 2, 6], 3: [6, 7]}


def test_drafts_are_cleared_by_the_next_step_and_bounded_by_max_model_len():
    batch = make_batch(max_model_len=8)
    row = batch.add_request(make_state("a", [1, 2, 3, 4, 5], [1]))
    batch.set_draft_token_ids({"a": [6, 7, 8]})
    assert batch.num_draft_tokens[row] == 3
    batch.set_draft_token_ids({})
    assert batch.num_draft_tokens[row] == 0 and batch.draft_token_ids(row) == []
    with pytest.raises(ValueError, match="'a' with 4 drafts would reach 9 tokens, more than "):
        batch.set_draft_token_ids({"a": [6, 7, 8, 9]})
    with pytest.raises(ValueError, match="drafts for request 'ghost', which is not scheduled"):
        batch.set_draft_token_ids({"ghost": [1]})


def test_the_same_rows_reuse_their_metadata_until_a_row_changes():
    """Decode steps of an unchanged batch reuse one metadata object; a row whose request
    leaves, arrives or moves (condense) gets the new request's parameters."""
    batch = make_batch()
    batch.add_request(make_state("a", [1], [1], temperature=0.0))
    batch.add_request(make_state("b", [1], [1], temperature=0.7, top_p=0.9, seed=3))
    rows = np.array([0, 1])
    first = batch.sampling_metadata(rows)
    batch.append_token_ids(0, [4])
    assert batch.sampling_metadata(np.array([0, 1])) is first
    assert batch.sampling_metadata(np.array([1])) is not first
    batch.remove_request("a")
    batch.add_request(make_state("c", [1], [1], temperature=1.3, top_k=5))
    replaced = batch.sampling_metadata(rows)
    assert replaced.temperature.tolist() == pytest.approx([1.3, 0.7])
    assert replaced.top_k.tolist() == [5, 0]
    batch.remove_request("c")
    batch.condense()  # "b" moves to row 0
    moved = batch.sampling_metadata(np.array([0]))
    assert moved.temperature.tolist() == pytest.approx([0.7])
    assert list(moved.generators) == [0]


@pytest.mark.parametrize(
    "params",
    [{"frequency_penalty": 0.5}, {"min_tokens": 3}, {"bad_words_token_ids": [[5, 6]]}],
)
def test_metadata_that_depends_on_the_history_is_built_every_step(params):
    batch = make_batch()
    row = batch.add_request(make_state("a", [1], [1], **params))
    rows = np.array([row])
    first = batch.sampling_metadata(rows)
    batch.append_token_ids(row, [5])
    second = batch.sampling_metadata(rows)
    assert second is not first


def test_metadata_of_verified_drafts_is_never_reused():
    batch = make_batch()
    batch.add_request(make_state("a", [1], [1]))
    rows, prefix = np.array([0, 0]), np.array([0, 1])
    assert batch.sampling_metadata(rows, prefix) is not batch.sampling_metadata(rows, prefix)
