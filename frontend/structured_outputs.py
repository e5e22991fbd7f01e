"""Checking an output constraint before its request is sent: an invalid JSON schema, regex or
grammar is the user's error, answered at once with xgrammar's reason, never a failed step.

Results are cached by constraint, so a schema that many requests share is checked once. The
first check imports xgrammar (and the torch it loads), which takes seconds: callers on an event
loop run it on a thread.
"""

from __future__ import annotations

import functools

import msgspec

from core_engine.common.grammars import GrammarUnavailableError, build_grammar
from core_engine.proto.sampling_params import StructuredOutputs

KIND_NAMES = {"json": "JSON schema", "grammar": "EBNF grammar"}


def check_structured_outputs(constraint: StructuredOutputs) -> None:
    """ValueError naming what is wrong with `constraint` (or that xgrammar is missing)."""
    problem = _problem(constraint.cache_key)
    if problem is not None:
        raise ValueError(problem)


@functools.lru_cache(maxsize=512)
def _problem(cache_key: bytes) -> str | None:
    constraint = msgspec.msgpack.decode(cache_key, type=StructuredOutputs)
    try:
        build_grammar(**constraint.grammar_spec())
    except GrammarUnavailableError as exc:
        return str(exc)
    except ValueError as exc:
        kind = next(n for n in constraint.__struct_fields__ if getattr(constraint, n))
        return f"invalid {KIND_NAMES.get(kind, kind)}: {exc}"
    return None
