"""`IncrementalDetokenizer`: token ids in, text deltas out, one request choice at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded ahead of the output, so that tokenizers whose first piece depends on
# its left neighbour (SentencePiece's leading space) decode the output as they would in context.
NUM_PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing output, emitting each character exactly once, when it is complete.

    Contract: the concatenation of every string returned by `update` and then `flush` equals
    `tokenizer.decode(output_token_ids)` for byte-level tokenizers. `update` never returns a
    string ending in U+FFFD: a character whose UTF-8 bytes are split over several tokens is held
    back until its last byte arrives (or `flush`, at the end, gives up on it).

    Invariant: `_token_ids[_prefix_offset:_read_offset]` decodes to text already emitted (or to
    prompt context), and `_read_offset` sits on a character boundary. Each step decodes only the
    window from `_prefix_offset`, so the cost per token does not grow with the output.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens and returns the text they complete ("" while a character is partial)."""
        self._token_ids.extend(new_token_ids)
        return self._decode_delta(allow_incomplete=False)

    def flush(self) -> str:
        """Returns the text still held back (a dangling partial character decodes to U+FFFD)."""
        return self._decode_delta(allow_incomplete=True)

    def _decode_delta(self, allow_incomplete: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
