"""Output grammars for structured outputs, built with xgrammar (the optional `structured` extra):
a JSON schema, any JSON object, a regular expression, a choice of strings or an EBNF grammar.

The frontend builds one to refuse a bad constraint with a clear error before a request is sent;
the worker builds the same one to compile it against the model's vocabulary. xgrammar is
imported on first use only: it loads torch and transformers, which `common/` never does at import.
"""

from __future__ import annotations

import json
import re
from typing import Any

INSTALL_HINT = (
    "structured outputs need the xgrammar package: pip install 'core-engine[structured]', then "
    "restart the server (a running engine does not load a package installed after it started)"
)
# JSON without free whitespace: a model cannot wander off into endless newlines, and the output is
# still valid JSON for any parser.
ANY_WHITESPACE = False
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarUnavailableError(RuntimeError):
    """xgrammar is not installed."""

    def __init__(self) -> None:
        super().__init__(INSTALL_HINT)


def xgrammar() -> Any:
    """The xgrammar module; GrammarUnavailableError when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise GrammarUnavailableError() from None
    return xgr


def build_grammar(
    *,
    json_schema: str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    ebnf: str | None = None,
) -> Any:
    """The xgrammar `Grammar` of exactly one constraint. ValueError with xgrammar's reason (its
    source location removed) for an invalid schema, regex or grammar."""
    xgr = xgrammar()
    try:
        if json_schema is not None:
            return xgr.Grammar.from_json_schema(json_schema, any_whitespace=ANY_WHITESPACE)
        if json_object:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ANY_WHITESPACE)
        if regex is not None:
            return xgr.Grammar.from_regex(regex)
        if choice is not None:
            literals = (json.dumps(option, ensure_ascii=False) for option in choice)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
        if ebnf is not None:
            return xgr.Grammar.from_ebnf(ebnf)
    except RuntimeError as exc:
        raise ValueError(_XGRAMMAR_LOCATION.sub("", str(exc).strip())) from None
    raise ValueError("no constraint given")
