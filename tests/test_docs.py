"""The documentation stays true: every ```python block of docs/*.md runs, docs/api.md has an
entry for every public name (the site renders it from the docstrings, see tests/test_docs_site.py),
and every docstring example of the public API passes doctest.

Markdown snippets run file by file, in order, in one fresh namespace per file (a block may use
names defined by an earlier block of the same file). A long file may split into parts at lines
``<!-- test: new part -->`` (an HTML comment: invisible on the site): each part runs in its own
namespace (its own test, so the parts run in parallel) after the file's preamble, the blocks
before its first ``## `` heading; a part must not use names defined in another part.
docs/cookbook.md's blocks run in
tests/test_cookbook.py instead (timed, and not twice). Code that is not meant to run must use
another fence language (```text, ```bash, ```pycon). A file whose blocks need an optional
dependency says so on a line ``<!-- requires: module -->``; its blocks are skipped when the module
is not installed.
"""

from __future__ import annotations

import doctest
import inspect
import io
import re
from pathlib import Path

import pytest

import chunkop

DOCS = Path(__file__).resolve().parents[1] / "docs"
MARKDOWN = sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_OPENING = re.compile(r"^[ \t]*```+[ \t]*python\b", re.MULTILINE)
_REQUIRES = re.compile(r"^<!-- requires: ([\w.]+) -->$", re.MULTILINE)
_PART = re.compile(r"^<!-- test: new part -->$", re.MULTILINE)
_H2 = re.compile(r"^## ", re.MULTILINE)
PUBLIC = [name for name in chunkop.__all__ if name != "__version__"]
RUN_ELSEWHERE = {"cookbook.md"}  # tests/test_cookbook.py


def _line_of(text: str, match: re.Match | None) -> float:
    """The line of ``text`` where ``match`` starts (1-based); infinity for no match."""
    return text.count("\n", 0, match.start()) + 1 if match else float("inf")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every top-level ```python block in ``path``."""
    text = path.read_text()
    return [(_line_of(text, m), m.group(1)) for m in _BLOCK.finditer(text)]


# ------------------------------------------------------------------------------------------------
# Markdown snippets.


def test_docs_exist():
    names = {p.name for p in MARKDOWN}
    assert {"index.md", "guide.md", "design.md", "api.md"} <= names
    for name in ("index.md", "guide.md", "design.md"):
        assert python_blocks(DOCS / name), f"docs/{name} has no ```python block"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_python_fence_is_extracted(path):
    """No ```python block is skipped (e.g. an indented fence inside a list)."""
    text = path.read_text()
    assert len(_OPENING.findall(text)) == len(python_blocks(path)), (
        f"{path.name}: a ```python fence is indented or unterminated; write python blocks at "
        f"the top level so tests/test_docs.py runs them"
    )


def python_parts(path: Path) -> list[list[tuple[int, str]]]:
    """The blocks of ``path`` to run, one list per part (see the module docstring)."""
    text = path.read_text()
    blocks = python_blocks(path)
    starts = [_line_of(text, m) for m in _PART.finditer(text)]
    if not starts:
        return [blocks]
    preamble_end = _line_of(text, _H2.search(text))
    preamble = [b for b in blocks if b[0] < preamble_end]
    bounds = [preamble_end, *starts, float("inf")]
    return [preamble + [b for b in blocks if lo <= b[0] < hi] for lo, hi in zip(bounds, bounds[1:])]


_PAGE_PARTS = [
    pytest.param(path, i, id=path.name if len(parts) == 1 else f"{path.name}:{i + 1}")
    for path in MARKDOWN
    if path.name not in RUN_ELSEWHERE
    for parts in [python_parts(path)]
    for i in range(len(parts))
]


def test_parts_cover_every_block():
    """A split page runs each block once, its preamble first in every part."""
    for path in MARKDOWN:
        parts, blocks = python_parts(path), python_blocks(path)
        preamble = [b for b in parts[0] if all(b in part for part in parts)] if len(parts) > 1 else []
        assert all(part[: len(preamble)] == preamble for part in parts), path.name
        rest = [b for part in parts for b in part[len(preamble) :]]
        assert sorted(preamble + rest) == sorted(blocks), path.name


@pytest.mark.parametrize(("path", "part"), _PAGE_PARTS)
def test_markdown_python_blocks_run(path, part):
    for module in _REQUIRES.findall(path.read_text()):
        pytest.importorskip(module)
    namespace: dict = {"__name__": f"docs.{path.stem}"}
    for line, code in python_parts(path)[part]:
        # Pad with newlines so that tracebacks point at the line of the .md file.
        exec(compile("\n" * line + code, str(path), "exec"), namespace)


def test_design_md_names_every_module():
    """docs/design.md's module map has a row for every module of the package."""
    text = (DOCS / "design.md").read_text()
    package = Path(chunkop.__file__).resolve().parent
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    missing = [m for m in modules if f"| `{m}` |" not in text]
    assert not missing, f"docs/design.md's module map has no row for {missing}"


_PRIVATE = re.compile(r"\bchunkop\._(?!_)\w+")  # chunkop.__all__ / __version__ are public
# Pages that still point users at private names; remove an entry once its page is fixed (the
# xfail is strict, so a fixed page fails here until its entry goes).
_PRIVATE_PENDING: dict[str, str] = {}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=_PRIVATE_PENDING[p.name]))
        if p.name in _PRIVATE_PENDING
        else p
        for p in MARKDOWN
    ],
    ids=lambda p: p.name,
)
def test_docs_name_only_public_api(path):
    """Users are pointed at ``chunkop.<public name>`` only: no ``chunkop._module.NAME``, no
    ``from chunkop._module import``. (The design note may name source files, ``_cache.py``.)"""
    found = sorted(set(_PRIVATE.findall(path.read_text())))
    assert not found, f"{path.name} names private chunkop internals: {found}"


# ------------------------------------------------------------------------------------------------
# The API reference.


def test_api_md_documents_every_public_name():
    text = (DOCS / "api.md").read_text()
    for name in chunkop.__all__:
        if name != "__version__":
            assert f"::: chunkop.{name}\n" in text, f"docs/api.md has no `::: chunkop.{name}` entry"


# ------------------------------------------------------------------------------------------------
# Docstring examples.

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _doctests(name: str) -> list[doctest.DocTest]:
    obj = getattr(chunkop, name)
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests = finder.find(obj, f"chunkop.{name}", module=inspect.getmodule(obj), globs={})
    return [t for t in tests if t.examples]


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples(name):
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    for test in _doctests(name):
        runner.run(test, out=out.write)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, out.getvalue()


@pytest.mark.parametrize("name", PUBLIC)
def test_public_objects_have_examples(name):
    assert sum(len(t.examples) for t in _doctests(name)) > 0, f"chunkop.{name} has no docstring example"
