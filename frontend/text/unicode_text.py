"""Text that cannot be encoded as UTF-8: lone surrogates, which JSON's `\\uD800` escapes (and
Python strings) can carry, but no tokenizer, wire codec or JSON response can hold."""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def describe_text_not_utf8(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8 ("surrogates not allowed (U+D800 at position 3)"),
    or None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{exc.reason} (U+{ord(text[exc.start]):04X} at position {exc.start})"
    return None


def find_text_not_utf8(value: Any, path: str = "") -> tuple[str, str] | None:
    """The JSON path (`stop[0]`, `messages[1].content`) of the first string or object key
    inside `value` that cannot be encoded as UTF-8, and why; None when every one can.

    A key's path ends with the key itself; paths never contain the bad text (they are safe to
    print and to send back)."""
    if isinstance(value, str):
        reason = describe_text_not_utf8(value)
        return None if reason is None else (path or "the request body", reason)
    if isinstance(value, dict):
        for key, item in value.items():
            item_path = json_path(path, key)
            if isinstance(key, str) and (reason := describe_text_not_utf8(key)) is not None:
                return item_path, f"the key: {reason}"
            if (found := find_text_not_utf8(item, item_path)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := find_text_not_utf8(item, f"{path}[{index}]")) is not None:
                return found
    return None


def json_path(path: str, key: Any) -> str:
    """`path` extended by an object key: `.name` for a plain name, else `["k"]` in JSON's
    ASCII escapes."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def printable_text(text: str) -> str:
    """`text` with what UTF-8 cannot encode written as backslash escapes (`\\ud800`)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
