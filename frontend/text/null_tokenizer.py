"""`NullTokenizer`: the tokenizer of the "null" model, one token per UTF-8 byte.

It lets the whole serving stack (detokenizer, stop strings, HTTP) run without a model file.
Ids 0..255 are the bytes; any larger id is a special token that decodes to "" when special
tokens are skipped and to `<|id|>` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_BYTE_TOKENS = 256


class NullTokenizer:
    """Byte-level tokenizer with no eos token and a plain "role: content" chat template."""

    eos_token_id: int | None = None
    chat_template = "{role}: {content}\n"

    @property
    def eos_token_ids(self) -> list[int]:
        return []

    @property
    def vocab_size(self) -> int:
        return NUM_BYTE_TOKENS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Bytes decode with U+FFFD for incomplete or invalid UTF-8, like a byte-level BPE."""
        chunks: list[bytes] = []
        for token_id in token_ids:
            if token_id < NUM_BYTE_TOKENS:
                chunks.append(bytes((token_id,)))
            elif not skip_special_tokens:
                chunks.append(f"<|{token_id}|>".encode())
        return b"".join(chunks).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(token_id) for token_id in token_ids]

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(self.chat_template.format(**m) for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
