"""`Tokenizer`: text <-> token ids and chat templates, from an HF folder or a GGUF file.

Built on the `tokenizers` library (no torch, no transformers). An HF folder provides
tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json); a GGUF
file provides the vocabulary, merges or scores, token types and special ids as metadata, from
which the tokenizer llama.cpp would use is rebuilt: byte-level BPE (pre-tokenizer chosen by
`tokenizer.ggml.pre`) or SentencePiece BPE with byte fallback. Chat templates render in a
sandboxed jinja2 environment configured like transformers' (trim_blocks, lstrip_blocks, loop
controls, `tojson`, `raise_exception`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from core_engine.common.eos_tokens import gguf_eos_token_ids, hf_eos_token_ids
from core_engine.common.gguf_file import GGUFFile
from core_engine.common.json_file import read_json
from core_engine.common.model_files import (
    TOKENIZER_CONFIG_FILE_NAME,
    TOKENIZER_FILE_NAME,
    is_gguf_file,
)
from core_engine.frontend.text.chat_templates import default_gguf_chat_template

CHAT_TEMPLATE_FILE_NAME = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE_NAME = "chat_template.json"

SENTENCEPIECE_SPACE = "\u2581"
# llama.cpp token types (tokenizer.ggml.token_type).
GGUF_CONTROL_TOKEN = 3
GGUF_USER_DEFINED_TOKEN = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> regexes applied in order before byte-level BPE (as llama.cpp does).
GGUF_PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}


class Tokenizer:
    """Encodes, decodes and renders chat templates for one model.

    `eos_token_ids` holds every stop id: the tokenizer's eos token first, then those of
    generation_config.json and config.json (HF) or eot/eom ids (GGUF), without duplicates.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: dict[str, str | None],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._compiled_chat_template = None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        token_id = self._special_token_id("eos_token")
        if token_id is None and self.eos_token_ids:
            return self.eos_token_ids[0]
        return token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special added token and of the named special tokens."""
        ids = {
            token_id
            for token_id, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }
        for name in self.special_tokens:
            token_id = self._special_token_id(name)
            if token_id is not None:
                ids.add(token_id)
        return sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids.

        `add_special_tokens` applies the post-processor (e.g. a leading bos for Llama 3). Runs
        without the GIL (the batch entry point releases it), so a long text tokenized on a
        worker thread does not stall the event loop.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; incomplete UTF-8 at either end decodes to U+FFFD."""
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level spelling), None if out of range."""
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(token_id) for token_id in token_ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The conversation rendered as text (special tokens spelled out; encode it with
        add_special_tokens=False). Extra keyword arguments (tools, enable_thinking, ...) are
        passed to the template. Raises ValueError when the model has no chat template."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json, "
                "chat_template.jinja or the GGUF metadata); send a plain prompt instead"
            )
        if self._compiled_chat_template is None:
            self._compiled_chat_template = compile_chat_template(self.chat_template)
        return self._compiled_chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{name: token or "" for name, token in self.special_tokens.items()},
            **template_kwargs,
        )

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of an HF folder or a GGUF file.

    Raises FileNotFoundError naming a missing file, ValueError for an unsupported tokenizer.
    """
    path = Path(path)
    if is_gguf_file(path):
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path)


def load_hf_tokenizer(folder: Path) -> Tokenizer:
    """From tokenizer.json, tokenizer_config.json, chat_template.jinja/.json and the eos ids
    of generation_config.json and config.json."""
    tokenizer_path = folder / TOKENIZER_FILE_NAME
    if not tokenizer_path.is_file():
        hint = (
            " (only a SentencePiece tokenizer.model is there, which is not supported)"
            if (folder / "tokenizer.model").is_file()
            else ""
        )
        raise FileNotFoundError(f"model folder {str(folder)!r} has no {TOKENIZER_FILE_NAME}{hint}")
    backend = BackendTokenizer.from_file(str(tokenizer_path))
    config = read_json(folder / TOKENIZER_CONFIG_FILE_NAME)
    special_tokens = {
        name: _token_content(config.get(name))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    eos_token_ids = hf_eos_token_ids(folder)
    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        eos_token_ids=eos_token_ids,
        chat_template=_hf_chat_template(folder, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """Rebuilds the tokenizer that GGUF metadata describes: byte-level BPE ("gpt2" model,
    pre-tokenizer chosen by `tokenizer.ggml.pre`) or SentencePiece BPE ("llama" model: Llama 2,
    Mistral, TinyLlama and their kin).

    Raises ValueError for other tokenizer models, and for a `tokenizer.ggml.pre` whose split
    rules are unknown.
    """
    gguf_file = GGUFFile(path)
    field = gguf_file.field
    tokenizer_model = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    backend = _gguf_backend(field, tokenizer_model, tokens)
    special_tokens = _gguf_special_tokens(field, tokens)
    # llama.cpp adds bos by default for SentencePiece vocabularies, not for byte-level ones.
    add_bos = field("tokenizer.ggml.add_bos_token", tokenizer_model == "llama")
    add_eos = field("tokenizer.ggml.add_eos_token", False)
    _set_special_token_post_processor(
        backend,
        bos=special_tokens["bos_token"] if add_bos else None,
        eos=special_tokens["eos_token"] if add_eos else None,
    )
    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        eos_token_ids=gguf_eos_token_ids(gguf_file),
        chat_template=field("tokenizer.chat_template")
        or default_gguf_chat_template(field("general.architecture")),
    )


def _gguf_backend(field: Callable, tokenizer_model: str, tokens: list[str]) -> BackendTokenizer:
    """The `tokenizers` model of a "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE) GGUF
    vocabulary; ValueError for other models and unknown pre-tokenizers."""
    token_types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if tokenizer_model == "gpt2":
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZER_SPLITS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                f"{', '.join(GGUF_PRE_TOKENIZER_SPLITS)}"
            )
        merges = field("tokenizer.ggml.merges") or []
        return build_byte_level_bpe(tokens, merges, token_types, GGUF_PRE_TOKENIZER_SPLITS[pre])
    if tokenizer_model == "llama":
        return build_sentencepiece_bpe(
            tokens,
            field("tokenizer.ggml.scores"),
            token_types,
            field("tokenizer.ggml.merges"),
            add_space_prefix=field("tokenizer.ggml.add_space_prefix", True),
        )
    raise ValueError(
        f"GGUF tokenizer model {tokenizer_model!r} is not supported (supported: 'gpt2', "
        "byte-level BPE, and 'llama', SentencePiece BPE); use the model's Hugging Face "
        "folder with its tokenizer.json"
    )


def _gguf_special_tokens(field: Callable, tokens: list[str]) -> dict[str, str | None]:
    """bos, eos, unk and pad tokens named by the GGUF metadata's token ids (None if unset)."""

    def token_at(key: str) -> str | None:
        token_id = field(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    return {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }


def build_byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], splits: Sequence[str]
) -> BackendTokenizer:
    """A GPT-2-style tokenizer: `splits` regexes, then bytes -> unicode, then BPE merges.

    Control tokens become special added tokens, user-defined ones plain added tokens, so both
    are matched whole in the text, as llama.cpp does.
    """
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, token_types)
    return backend


def _add_typed_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so
    both are matched whole in the text, as llama.cpp does."""
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in typed
            if kind == GGUF_CONTROL_TOKEN
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in typed
            if kind == GGUF_USER_DEFINED_TOKEN
        ]
    )


def build_sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    token_types: list[int],
    merges: list[str] | None = None,
    add_space_prefix: bool = True,
) -> BackendTokenizer:
    """A SentencePiece BPE tokenizer (Llama 2 style): spaces are spelled U+2581 and one is put
    before the text (unless `add_space_prefix` is False, as for Gemma), pieces merge by score,
    and characters outside the vocabulary fall back to its `<0xNN>` byte tokens. The merges are
    the file's when it lists them, else the ones the scores imply (`merges_from_scores`).
    """
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if merges:
        merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    elif scores is not None:
        merge_pairs = merges_from_scores(tokens, scores)
    else:
        raise ValueError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores or merges")
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SENTENCEPIECE_SPACE,
        prepend_scheme="first" if add_space_prefix else "never",
        split=False,
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SENTENCEPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
        + ([decoders.Strip(content=" ", left=1)] if add_space_prefix else [])
    )
    _add_typed_tokens(backend, tokens, token_types)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every way to cut a piece into two
    pieces of the vocabulary, the best-scored merged piece first (ties: longer left part, then
    longer right part, then the parts' ids), so BPE rebuilds the pieces SentencePiece would."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, -len(left), -len(right), vocab[left], vocab[right]))
    candidates.sort()
    return [(tokens[left_id], tokens[right_id]) for *_, left_id, right_id in candidates]


def compile_chat_template(source: str):
    """A jinja2 template in an immutable sandbox, with transformers' chat-template helpers."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: drop spaces before punctuation/contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _set_special_token_post_processor(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> None:
    if bos is None and eos is None:
        return
    prefix = [f"{bos}:0"] if bos else []
    suffix = [f"{eos}:0"] if eos else []
    special_tokens = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    backend.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=list(dict.fromkeys(special_tokens)),
    )


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template_path = folder / CHAT_TEMPLATE_FILE_NAME
    if template_path.is_file():
        return template_path.read_text(encoding="utf-8")
    template = read_json(folder / CHAT_TEMPLATE_JSON_FILE_NAME).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def _token_content(value: str | dict | None) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        return value.get("content")
    return value
