"""Our tokenizer encodes, decodes and renders chat templates exactly like transformers'.

References: transformers' tokenizer loaded from the same GGUF (`gguf_file=`), from
transformers' conversion of it (an HF folder), and from a tiny byte-level HF folder.
"""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from core_engine.common.model_files import default_model_path
from core_engine.frontend.text.tokenizer import load_tokenizer
from tests.helpers.model_fixtures import (
    build_tiny_model_folder,
    write_byte_level_tokenizer,
)
from tools.reference_model import converted_default_model_folder

CORPUS = (
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we've paid $1,234.56.",
    "Café naïve résumé déjà vu, Ærøskøbing, Straße, ÉCOLE",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji: 🤗🚀 👩‍👩‍👧‍👦 🇫🇷 ❤️ and a lone \u200d joiner",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\n  indented\r\n\twindows line",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '{"key": [1, 2, 3], "nested": {"a": null}} // comment && x != y || z >= 10',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<repo_name>name<file_sep>",
    "not special: <|im_starts|> <|fake|> < |im_end| >",
    "numbers 0 7 42 31415926535 2024-01-31 3.14e-10 0x1F",
    "Ελληνικά, русский текст, العربية, हिन्दी, ไทย",
    "combining: e\u0301 a\u0308 n\u0303 and zero width\u200bspace",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" + "!" * 40 + " " * 33 + "end",
)
CONVERSATIONS = (
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in français: é?"},
    ],
)


@pytest.fixture(scope="module")
def gguf_tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def transformers_gguf_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def converted_folder():
    return converted_default_model_folder()


def assert_same_tokenization(ours, reference, texts) -> None:
    for text in texts:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
        ids = reference.encode(text)
        for skip in (True, False):
            expected_text = reference.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected_text, text


@pytest.mark.slow
def test_gguf_tokenizer_encodes_and_decodes_like_transformers(
    gguf_tokenizer, transformers_gguf_tokenizer
):
    assert_same_tokenization(gguf_tokenizer, transformers_gguf_tokenizer, CORPUS)


def test_gguf_tokenizer_round_trips_and_keeps_special_tokens_whole(gguf_tokenizer):
    for text in CORPUS:
        assert gguf_tokenizer.decode(gguf_tokenizer.encode(text), skip_special_tokens=False) == text
    im_start = gguf_tokenizer.token_to_id("<|im_start|>")
    assert gguf_tokenizer.encode("<|im_start|>user") == [im_start, *gguf_tokenizer.encode("user")]
    assert gguf_tokenizer.decode([im_start, *gguf_tokenizer.encode("user")]) == "user"


def test_gguf_tokenizer_decodes_arbitrary_ids_like_transformers(
    gguf_tokenizer, transformers_gguf_tokenizer
):
    """Random id runs, including ones that split multi-byte characters (U+FFFD)."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(gguf_tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            expected = transformers_gguf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert gguf_tokenizer.decode(ids, skip_special_tokens=skip) == expected, ids
    emoji_ids = gguf_tokenizer.encode("🤗")
    assert len(emoji_ids) > 1
    assert gguf_tokenizer.decode(emoji_ids[:1]) == transformers_gguf_tokenizer.decode(emoji_ids[:1])


def is_non_ascii_numeric(char: str) -> bool:
    return unicodedata.category(char).startswith("N") and not char.isascii()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_gguf_tokenizer_matches_transformers_on_random_text(
    gguf_tokenizer, transformers_gguf_tokenizer, text
):
    # See test_gguf_tokenizer_isolates_numeric_characters_like_llama_cpp for the exception.
    assume(not any(is_non_ascii_numeric(char) for char in text))
    assert gguf_tokenizer.encode(text) == transformers_gguf_tokenizer.encode(text)


def test_gguf_tokenizer_isolates_numeric_characters_like_llama_cpp(gguf_tokenizer):
    """tokenizer.ggml.pre = "smollm": every numeric character is its own pre-token (llama.cpp's
    `\\p{N}` split, the original tokenizer's Digits(individual_digits=True)). transformers'
    GGUF loader ignores the pre type, which differs only when a non-ASCII numeric character's
    bytes could merge with a neighbour (" ¼" -> "ĠÂ" + "¼"); the vocabulary itself shows the
    split is right: no token mixes a numeric character with anything else."""
    vocab_texts = (gguf_tokenizer.decode([i]) for i in range(gguf_tokenizer.vocab_size))
    mixed = [
        t
        for t in vocab_texts
        if len(t) > 1 and any(unicodedata.category(c).startswith("N") for c in t)
    ]
    assert mixed == []
    for pieces in ([" ", "¼"], ["x", "²", " ", "1", "2", "3"], ["٣", "4", "x"]):
        isolated = [token_id for piece in pieces for token_id in gguf_tokenizer.encode(piece)]
        assert gguf_tokenizer.encode("".join(pieces)) == isolated, pieces


def test_gguf_tokenizer_special_ids_match_transformers(gguf_tokenizer, transformers_gguf_tokenizer):
    reference = transformers_gguf_tokenizer
    assert gguf_tokenizer.vocab_size == len(reference) == 49152
    assert gguf_tokenizer.bos_token_id == reference.bos_token_id == 1
    assert gguf_tokenizer.eos_token_id == reference.eos_token_id == 2
    assert gguf_tokenizer.eos_token_ids == (2,)
    assert set(reference.all_special_ids) <= set(gguf_tokenizer.all_special_ids)
    assert gguf_tokenizer.convert_ids_to_tokens(
        [0, 1, 2, 19556]
    ) == reference.convert_ids_to_tokens([0, 1, 2, 19556])
    assert gguf_tokenizer.id_to_token(10**9) is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_renders_like_transformers(
    gguf_tokenizer, transformers_gguf_tokenizer, add_generation_prompt
):
    for messages in CONVERSATIONS:
        expected = transformers_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        rendered = gguf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>")


def test_converted_folder_tokenizer_matches_transformers(converted_folder, gguf_tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(converted_folder)
    ours = load_tokenizer(converted_folder)
    assert_same_tokenization(ours, reference, CORPUS)
    assert ours.chat_template == gguf_tokenizer.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, (2,))
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_tiny_folder_tokenizer_matches_transformers_and_reads_generation_eos(tmp_path):
    from transformers import AutoTokenizer

    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    generation_config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**generation_config, "eos_token_id": [2, 0]})
    )
    ours = load_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    assert_same_tokenization(ours, reference, CORPUS)
    assert ours.eos_token_id == 2  # tokenizer_config's eos_token, <|im_end|>
    assert ours.eos_token_ids == (2, 0)
    messages = CONVERSATIONS[0]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chat_template_errors_are_clear(tmp_path):
    folder = tmp_path / "no_template"
    folder.mkdir()
    write_byte_level_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])

    (folder / "chat_template.jinja").write_text(
        "{{ raise_exception('only user turns, got ' + messages[0]['role']) }}"
    )
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="only user turns, got system"):
        load_tokenizer(folder).apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    from jinja2.exceptions import SecurityError

    folder = tmp_path / "sandbox"
    folder.mkdir()
    write_byte_level_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(
        "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(SecurityError):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_tokenizer(tmp_path / "missing.gguf")
