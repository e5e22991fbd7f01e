"""IncrementalDetokenizer: characters split over tokens come out once, whole, never as U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_engine.common.model_files import resolve_model_path
from core_engine.frontend.text.detokenizer import IncrementalDetokenizer
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.frontend.text.tokenizer import load_tokenizer

MULTILINGUAL_TEXTS = [
    "Hello 😀 world",
    "世界你好，这是一个测试。",
    "naïve café — 🇫🇷 flags and 👩‍👩‍👧 families",
    "日本語とEnglishの混在 🎉🎉",
    "  leading spaces\nand\ttabs ∑∫√",
]


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = [detokenizer.update([token_id]) for token_id in token_ids]
    deltas.append(detokenizer.flush())
    return deltas


def test_null_tokenizer_holds_a_split_character_until_its_last_byte():
    tokenizer = NullTokenizer()
    token_ids = tokenizer.encode("a😀b")  # 1 + 4 + 1 bytes
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[]), token_ids)
    assert deltas == ["a", "", "", "", "😀", "b", ""]


def test_flush_gives_up_on_a_dangling_partial_character():
    tokenizer = NullTokenizer()
    token_ids = tokenizer.encode("a😀")[:3]
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[]), token_ids)
    assert deltas == ["a", "", "", "\ufffd"]
    assert "".join(deltas) == tokenizer.decode(token_ids)


def test_prompt_context_is_not_emitted():
    tokenizer = NullTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt 世界 "))
    assert "".join(stream(detokenizer, tokenizer.encode("out 😀"))) == "out 😀"


def test_special_tokens_are_skipped_or_spelled_out():
    tokenizer = NullTokenizer()
    token_ids = [*tokenizer.encode("ab"), 300, *tokenizer.encode("c")]
    skipped = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), token_ids)
    spelled = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), token_ids)
    assert "".join(skipped) == "abc"
    assert "".join(spelled) == "ab<|300|>c"


@settings(max_examples=200, deadline=None)
@given(token_ids=st.lists(st.integers(0, 255), max_size=40))
def test_null_tokenizer_deltas_concatenate_to_decode(token_ids):
    tokenizer = NullTokenizer()
    deltas = stream(IncrementalDetokenizer(tokenizer, []), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.mark.parametrize("text", MULTILINGUAL_TEXTS)
def test_smollm2_stream_matches_decode(smollm2_tokenizer, text):
    token_ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = smollm2_tokenizer.encode("Translate:", add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(smollm2_tokenizer, prompt_ids), token_ids)
    assert "".join(deltas) == smollm2_tokenizer.decode(token_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_smollm2_emoji_split_over_tokens_is_emitted_once(smollm2_tokenizer):
    token_ids = smollm2_tokenizer.encode("😀", add_special_tokens=False)
    assert len(token_ids) > 1, "the test needs an emoji that spans several tokens"
    deltas = stream(IncrementalDetokenizer(smollm2_tokenizer, []), token_ids)
    assert [delta for delta in deltas if delta] == ["😀"]
    assert deltas[len(token_ids) - 1] == "😀"


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_smollm2_random_token_ids_concatenate_to_decode(smollm2_tokenizer, data):
    vocab_size = 49152
    token_ids = data.draw(st.lists(st.integers(0, vocab_size - 1), max_size=24))
    deltas = stream(IncrementalDetokenizer(smollm2_tokenizer, []), token_ids)
    assert "".join(deltas) == smollm2_tokenizer.decode(token_ids)
