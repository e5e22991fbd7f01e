"""The ids that end generation for a model, read from its files: one reader, so the tokenizer
(frontend) and the model config (worker, which reports them in its handshake) agree.

Order matters: the first id is the model's eos (a request that ends on it has no stop reason),
the others stop a request as stop tokens. Both orders follow the tokenizer's view, as
transformers and vLLM do: the tokenizer's own eos token (a chat model's turn end), then
generation_config.json's ids, then config.json's (HF folder); eos, then end-of-turn and
end-of-message ids (GGUF).
"""

from __future__ import annotations

from pathlib import Path

from core_engine.common.gguf_file import GGUFFile
from core_engine.common.json_file import read_json
from core_engine.common.model_files import (
    GENERATION_CONFIG_FILE_NAME,
    HF_CONFIG_FILE_NAME,
    TOKENIZER_CONFIG_FILE_NAME,
    TOKENIZER_FILE_NAME,
)

GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
GGUF_EOT_KEY = "tokenizer.ggml.eot_token_id"
# End-of-turn tokens that llama.cpp finds by their text when a GGUF names no eot id (its
# converter leaves Gemma's <end_of_turn> out of the metadata). Only the ones that no model
# served before relied on being absent: adding "<|endoftext|>" would change SmolLM2's stops.
GGUF_END_OF_TURN_TOKENS = ("<end_of_turn>",)


def gguf_eos_token_ids(gguf_file: GGUFFile) -> tuple[int, ...]:
    """eos, end-of-turn and end-of-message ids of a GGUF file, without duplicates; without an
    eot id in the metadata, a token spelled like one of GGUF_END_OF_TURN_TOKENS is it."""
    token_ids = [gguf_file.field(key) for key in GGUF_EOS_KEYS]
    if gguf_file.field(GGUF_EOT_KEY) is None:
        tokens = gguf_file.field("tokenizer.ggml.tokens") or []
        token_types = gguf_file.field("tokenizer.ggml.token_type") or []
        token_ids += _control_token_ids(tokens, token_types, GGUF_END_OF_TURN_TOKENS)
    return _unique(token_ids)


def _control_token_ids(
    tokens: list[str], token_types: list[int], texts: tuple[str, ...]
) -> list[int]:
    """Ids of the tokens spelled as one of `texts` (in that order) that are control tokens
    (token type 3) or untyped; a normal token that happens to read the same is no stop."""
    text_to_id = {}
    for token_id, token in enumerate(tokens):
        if token in texts and token not in text_to_id:
            is_control = token_id >= len(token_types) or token_types[token_id] == 3
            if is_control:
                text_to_id[token] = token_id
    return [text_to_id[text] for text in texts if text in text_to_id]


def hf_eos_token_ids(folder: Path) -> tuple[int, ...]:
    """The tokenizer's eos token, then generation_config.json's and config.json's eos ids, of a
    Hugging Face folder (missing files contribute nothing), without duplicates."""
    return _unique(
        [tokenizer_eos_token_id(folder)]
        + _as_list(read_json(folder / GENERATION_CONFIG_FILE_NAME).get("eos_token_id"))
        + _as_list(read_json(folder / HF_CONFIG_FILE_NAME).get("eos_token_id"))
    )


def tokenizer_eos_token_id(folder: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`, looked up in tokenizer.json's added tokens,
    then in its model's vocabulary; None without either file or token."""
    eos_token = read_json(folder / TOKENIZER_CONFIG_FILE_NAME).get("eos_token")
    if isinstance(eos_token, dict):  # a serialized AddedToken
        eos_token = eos_token.get("content")
    if not eos_token:
        return None
    tokenizer = read_json(folder / TOKENIZER_FILE_NAME)
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos_token:
            return int(added["id"])
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece: token -> id
        return vocab.get(eos_token)
    if isinstance(vocab, list):  # Unigram: [token, score] at index id
        return next((i for i, entry in enumerate(vocab) if entry[0] == eos_token), None)
    return None


def _as_list(value: int | list[int] | None) -> list[int | None]:
    return list(value) if isinstance(value, list) else [value]


def _unique(token_ids: list[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(token_id) for token_id in token_ids if token_id is not None))
