"""SentencePiece ("llama" model) GGUF tokenizers encode and decode exactly like transformers'.

No SentencePiece model ships with the test dependencies, so the fixture trains a small one the
way SentencePiece BPE does (spaces as U+2581 at word starts, most frequent pair merged first,
pieces scored by merge rank, `<0xNN>` byte tokens for everything else) on a corpus, writes it as
a Llama GGUF, and compares against transformers loading the same file (`gguf_file=`).
"""

from __future__ import annotations

import collections

import gguf
import pytest
import torch

from core_engine.frontend.text.tokenizer import load_tokenizer, merges_from_scores
from tests.frontend.test_tokenizer_parity import CORPUS

SPACE = "\u2581"
TRAINING_TEXT = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs. "
    "hello world, hello there! it's a small world after all. 12 34 56 78 90 "
    "café résumé naïve. def main(): return 0\n\tindented line\n"
) * 3
UNKNOWN, BOS, EOS = 0, 1, 2
NORMAL, UNKNOWN_TYPE, CONTROL, BYTE = 1, 2, 3, 6
NUM_MERGES = 120


def train_pieces(text: str, num_merges: int) -> list[str]:
    """SentencePiece-style BPE: the pieces made by the `num_merges` most frequent merges, best
    first, then the single characters the corpus uses."""
    words = collections.Counter(SPACE + word for word in text.split(" ") if word)
    spelled = {word: list(word) for word in words}
    merged_pieces: list[str] = []
    for _ in range(num_merges):
        pairs: collections.Counter = collections.Counter()
        for word, count in words.items():
            symbols = spelled[word]
            for left, right in zip(symbols, symbols[1:], strict=False):
                pairs[left, right] += count
        if not pairs:
            break
        (left, right), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merged_pieces.append(left + right)
        for word in words:
            symbols, index = spelled[word], 0
            while index < len(symbols) - 1:
                if (symbols[index], symbols[index + 1]) == (left, right):
                    symbols[index : index + 2] = [left + right]
                index += 1
    characters = sorted({character for word in words for character in word})
    return merged_pieces + [c for c in characters if c not in merged_pieces]


def sentencepiece_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """Tokens, token types and scores laid out as llama.cpp writes a Llama 2 vocabulary."""
    pieces = train_pieces(TRAINING_TEXT, NUM_MERGES)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{byte:02X}>" for byte in range(256)], *pieces]
    types = [UNKNOWN_TYPE, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(rank) for rank in range(len(pieces))]]
    return tokens, types, scores


def add_sentencepiece_tokenizer(writer: gguf.GGUFWriter, add_bos: bool) -> None:
    tokens, types, scores = sentencepiece_vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNKNOWN)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)


def write_sentencepiece_gguf(path, add_bos: bool) -> None:
    """Tokenizer metadata only (and the few Llama fields transformers' GGUF loader wants)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    add_sentencepiece_tokenizer(writer, add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TEXTS = (
    *CORPUS,
    "the fox",
    " the fox",
    "  two leading spaces and two trailing  ",
    "hello<s>world</s> again",
    "words the training never saw: zebra quiz 日本",
)


@pytest.fixture(scope="module", params=[True, False], ids=["add-bos", "no-bos"])
def tokenizers_pair(request, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("spm")
    write_sentencepiece_gguf(folder / "spm.gguf", add_bos=request.param)
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="spm.gguf")
    return load_tokenizer(folder / "spm.gguf"), reference


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    token_ids = reference.encode(text)
    assert ours.decode(token_ids, skip_special_tokens=True) == reference.decode(
        token_ids, skip_special_tokens=True
    )


def test_unseen_characters_fall_back_to_byte_tokens(tokenizers_pair):
    ours, _ = tokenizers_pair
    token_ids = ours.encode("quiz 日")
    byte_token_ids = [3 + byte for byte in "日".encode()]
    assert token_ids[-3:] == byte_token_ids
    assert ours.decode(token_ids, skip_special_tokens=True) == "quiz 日"


def test_merges_follow_the_merged_pieces_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [-10.0, -11.0, -12.0, -2.0, -1.0, -3.0]
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_other_tokenizer_models_are_refused_with_the_supported_ones(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'bert' is not supported.*'gpt2'.*'llama'"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    "text", ["the quick brown fox jumps", "hello world, café 日本 done", "a\n\tb"]
)
def test_streamed_output_text_is_the_text_in_context(tokenizers_pair, text):
    """Each streamed piece keeps the space SentencePiece spells into it ("▁fox" -> " fox"),
    which decoding the output alone would strip."""
    from core_engine.frontend.text.detokenizer import IncrementalDetokenizer

    ours, _ = tokenizers_pair
    token_ids = ours.encode(text, add_special_tokens=False)
    for split in range(1, len(token_ids)):
        prompt, output = token_ids[:split], token_ids[split:]
        if ours.decode(prompt).endswith("\ufffd"):
            continue  # a prompt cannot end inside a character
        detokenizer = IncrementalDetokenizer(ours, prompt)
        streamed = "".join(detokenizer.update([token_id]) for token_id in output)
        streamed += detokenizer.flush()
        assert ours.decode(prompt) + streamed == text


def test_an_engine_serves_a_sentencepiece_gguf_and_generates_like_transformers(tmp_path):
    """Text in, text out through LLM: the prompt tokens and the greedy continuation of a
    random-weight Llama match transformers', and the text is the continuation in context."""
    transformers = pytest.importorskip("transformers")
    from core_engine.frontend.llm import LLM
    from core_engine.proto import SamplingParams
    from tests.helpers.model_fixtures import write_gguf_from_transformers_model

    torch.manual_seed(0)
    tokens, _, _ = sentencepiece_vocabulary()
    config = transformers.LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    path = write_gguf_from_transformers_model(
        model,
        tmp_path / "spm.gguf",
        "llama",
        lambda writer: add_sentencepiece_tokenizer(writer, True),
    )
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    prompt = "the quick brown fox"
    prompt_ids = reference.encode(prompt)
    expected = []
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([prompt_ids + expected])).logits[0, -1]
            expected.append(int(logits.argmax()))

    with LLM(model=str(path), device="cpu", max_model_len=128) as llm:
        (output,) = llm.generate(
            [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == expected
    in_context = reference.decode(prompt_ids + expected, skip_special_tokens=True)
    assert output.outputs[0].text == in_context[len(prompt) :]
