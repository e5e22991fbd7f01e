"""OutputProcessor: stop strings, streamed deltas, n fan-in, late outputs after an abort."""

from __future__ import annotations

import pytest

from core_engine.frontend.output_processor import (
    OutputProcessor,
    core_request_ids,
    find_stop_string,
    num_stop_prefix_chars,
)
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.proto import EngineCoreOutput, FinishReason, SamplingParams, TokenLogprobs

TOKENIZER = NullTokenizer()


def make_processor(request_id: str = "req", **params) -> OutputProcessor:
    prompt_token_ids = TOKENIZER.encode("prompt")
    return OutputProcessor(
        request_id, "prompt", prompt_token_ids, SamplingParams(**params), TOKENIZER
    )


def core_output(
    request_id: str, text: str = "", finish: FinishReason | None = None, **fields
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, TOKENIZER.encode(text), finish_reason=finish, **fields)


def feed_text(processor: OutputProcessor, request_id: str, text: str) -> list[bool]:
    """One byte-token per core output, as the core would send them; returns the abort flags."""
    return [processor.process(core_output(request_id, char)) for char in text]


def test_core_request_ids_keep_the_id_for_one_choice_and_derive_them_for_more():
    assert core_request_ids("abc", 1) == ["abc"]
    assert core_request_ids("abc", 3) == ["0_abc", "1_abc", "2_abc"]


def test_find_stop_string_reports_the_earliest_match_in_the_new_text():
    assert find_stop_string("hello world", ["wor", "lo"], num_new_chars=11) == (3, "lo")
    assert find_stop_string("hello world", ["lo"], num_new_chars=3) is None
    # A match that began before the new characters but ends inside them counts.
    assert find_stop_string("hello world", ["o w"], num_new_chars=1) is None
    assert find_stop_string("hello w", ["o w"], num_new_chars=1) == (4, "o w")


def test_num_stop_prefix_chars_is_the_longest_suffix_that_may_start_a_stop_string():
    assert num_stop_prefix_chars("abc", ["cde"]) == 1
    assert num_stop_prefix_chars("abcd", ["cde", "bcdx"]) == 3
    assert num_stop_prefix_chars("abcde", ["cde"]) == 0  # a whole match is not a prefix
    assert num_stop_prefix_chars("abc", []) == 0


def test_stop_string_is_cut_from_the_text_and_the_core_request_aborted():
    processor = make_processor(stop=["STOP"], max_tokens=50)
    aborts = feed_text(processor, "req", "hello STOP after")
    assert aborts.index(True) == len("hello STOP") - 1
    assert aborts.count(True) == 1, "outputs after the stop are ignored"
    final = processor.make_final_output()
    assert final.finished
    assert final.outputs[0].text == "hello "
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "STOP"
    assert final.outputs[0].token_ids == TOKENIZER.encode("hello STOP")


def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back():
    processor = make_processor(stop=["STOP"], max_tokens=50, include_stop_str_in_output=True)
    deltas = []
    for char in "hi ST":
        processor.process(core_output("req", char))
        deltas.append(processor.make_delta_output().outputs[0].text)
    assert deltas == ["h", "i", " ", "S", "T"]
    aborts = feed_text(processor, "req", "OP more")
    assert aborts.index(True) == 1
    final = processor.make_final_output().outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("hi STOP", "stop", "STOP")


def test_streamed_deltas_hold_back_a_possible_stop_prefix_and_never_leak_it():
    processor = make_processor(stop=["</s>"], max_tokens=50)
    deltas = []
    for char in "a</b></s>tail":
        processor.process(core_output("req", char))
        if (delta := processor.make_delta_output()) is not None:
            deltas.append(delta.outputs[0].text)
    # "<" and "</" might start "</s>": held back until "b" rules that out.
    assert deltas == ["a", "", "", "</b", ">", "", "", "", ""]


def test_held_back_text_is_released_when_the_request_finishes():
    processor = make_processor(stop=["xyz"], max_tokens=3)
    processor.process(core_output("req", "ab"))
    assert processor.make_delta_output().outputs[0].text == "ab"
    processor.process(core_output("req", "x", FinishReason.LENGTH))
    delta = processor.make_delta_output()
    assert delta.outputs[0].text == "x"
    assert delta.outputs[0].finish_reason == "length"
    assert delta.finished
    assert processor.make_delta_output() is None


def test_stop_string_split_over_many_tokens_with_multibyte_characters():
    processor = make_processor(stop=["世界"], max_tokens=50)
    aborts = feed_text(processor, "req", "你好世界!")
    assert aborts[-2] is True  # the last byte of 界 completes the match
    assert processor.make_final_output().outputs[0].text == "你好"


def test_stop_strings_wait_for_min_tokens():
    processor = make_processor(stop=["a"], min_tokens=3, max_tokens=10)
    aborts = feed_text(processor, "req", "aba")
    assert aborts == [False, False, True]
    assert processor.make_final_output().outputs[0].text == "ab"


def test_delta_outputs_carry_new_tokens_and_a_single_finish():
    processor = make_processor(max_tokens=2, logprobs=1)
    logprob = TokenLogprobs(-0.5, 1, [104], [-0.5])
    processor.process(core_output("req", "h", new_logprobs=[logprob], num_cached_tokens=4))
    first = processor.make_delta_output()
    assert first.outputs[0].token_ids == [ord("h")]
    assert first.outputs[0].logprobs == [logprob]
    assert first.num_cached_tokens == 4
    assert not first.finished
    processor.process(core_output("req", "i", FinishReason.LENGTH, new_logprobs=[logprob]))
    second = processor.make_delta_output()
    assert second.outputs[0].token_ids == [ord("i")]
    assert second.outputs[0].logprobs == [logprob]
    assert second.finished and second.num_generated_tokens == 2
    assert processor.make_final_output().outputs[0].logprobs == [logprob, logprob]


def test_n_choices_fan_in_with_derived_ids_and_seeds():
    processor = make_processor(n=3, seed=7, max_tokens=4, stop_token_ids=[9])
    requests = processor.make_core_requests(eos_token_ids=[2, 5], arrival_time=1.0, priority=1)
    assert [r.request_id for r in requests] == ["0_req", "1_req", "2_req"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in requests)
    assert all(r.sampling_params.stop_token_ids == [9, 5] for r in requests)
    assert all(r.eos_token_id == 2 and r.priority == 1 for r in requests)

    processor.process(core_output("1_req", "b"))
    processor.process(core_output("0_req", "a", FinishReason.STOP, stop_reason=9))
    delta = processor.make_delta_output()
    assert [(o.index, o.text, o.finish_reason) for o in delta.outputs] == [
        (0, "a", "stop"),
        (1, "b", None),
    ]
    processor.process(core_output("2_req", "cc", FinishReason.LENGTH))
    assert not processor.finished
    assert processor.unfinished_core_request_ids == ["1_req"]
    processor.process(core_output("1_req", "B", FinishReason.LENGTH))
    final = processor.make_final_output()
    assert final.finished
    assert [(o.index, o.text) for o in final.outputs] == [(0, "a"), (1, "bB"), (2, "cc")]
    assert final.outputs[0].stop_reason == 9
    assert final.num_generated_tokens == 5


def test_ignore_eos_keeps_extra_eos_ids_out_of_stop_tokens():
    processor = make_processor(ignore_eos=True)
    (request,) = processor.make_core_requests(eos_token_ids=[2, 5], arrival_time=0.0)
    assert request.sampling_params.stop_token_ids == []
    assert request.request_id == "req"


def test_abort_finishes_running_choices_and_late_outputs_are_ignored():
    processor = make_processor(n=2)
    processor.process(core_output("0_req", "x", FinishReason.LENGTH))
    processor.abort()
    assert processor.finished
    assert processor.process(core_output("1_req", "late")) is False
    final = processor.make_final_output()
    assert [o.finish_reason for o in final.outputs] == ["length", "abort"]
    assert final.outputs[1].text == ""


def test_core_error_is_reported_on_the_request():
    processor = make_processor()
    processor.process(core_output("req", "", FinishReason.ERROR, error="prompt too long"))
    final = processor.make_final_output()
    assert final.error == "prompt too long"
    assert final.outputs[0].finish_reason == "error"


@pytest.mark.parametrize("n", [1, 2])
def test_make_delta_output_is_none_without_news(n):
    processor = make_processor(n=n)
    assert processor.make_delta_output() is None


def test_each_choice_is_taken_as_finished_once_however_it_ended():
    processor = make_processor(n=4, stop=["!"], max_tokens=50)
    feed_text(processor, "0_req", "ab")
    assert processor.take_newly_finished() == []
    feed_text(processor, "0_req", "c!d")  # a stop string, found here (the core runs on)
    processor.process(core_output("1_req", "x", FinishReason.LENGTH))
    assert [(c.index, c.finish_reason) for c in processor.take_newly_finished()] == [
        (0, "stop"),
        (1, "length"),
    ]
    processor.process(core_output("0_req", "", FinishReason.ABORT))  # the core's late answer
    assert processor.take_newly_finished() == []
    processor.abort(FinishReason.ERROR)  # the engine died
    finished = processor.take_newly_finished()
    assert [(c.index, c.finish_reason) for c in finished] == [(2, "error"), (3, "error")]
    processor.abort()
    assert processor.take_newly_finished() == []
