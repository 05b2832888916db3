"""docs/cookbook.md stays true: its ```python blocks run, in order, in one namespace (a recipe
may use what an earlier one defined), as a new user would paste them. Each block's time is
printed (``pytest -s``); the page's timing figures are prose, never asserted.

tests/test_docs.py runs the other pages' blocks and skips this one (it runs here).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cookbook.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_OPENING = re.compile(r"^[ \t]*```+[ \t]*python\b", re.MULTILINE)

# The recipes the page promises (section headings), in order.
RECIPES = [
    "Which tool when",
    "float32 solves with lineax",
    "Tikhonov-regularised least squares",
    "SciPy solvers in float64",
    "Solves inside `jax.grad`",
    "Implicit or dense?",
    "Tomography: rays through a grid",
]


def blocks() -> list[tuple[int, str]]:
    text = PAGE.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_page_has_its_recipes_and_is_in_the_nav():
    text = PAGE.read_text()
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert headings == RECIPES
    assert len(_OPENING.findall(text)) == len(blocks()), "an indented or unterminated ```python fence"
    for heading in RECIPES:  # every recipe has code that runs
        section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
        assert "```python\n" in section, f"recipe {heading!r} has no python block"
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1].split("\n\n", 1)[0]
    assert "cookbook.md" in nav


def test_cookbook_blocks_run_in_order(capsys):
    namespace: dict = {"__name__": "docs.cookbook"}
    timings = []
    for line, code in blocks():
        start = time.perf_counter()
        # Pad with newlines so that tracebacks point at the line of the .md file.
        exec(compile("\n" * line + code, str(PAGE), "exec"), namespace)
        timings.append((line, time.perf_counter() - start))
    # The recipes' results are checked by the asserts inside the blocks; a few cross-checks here:
    lx = pytest.importorskip("lineax")
    assert namespace["solution"].result == lx.RESULTS.successful
    assert namespace["istop"] in (1, 2)
    assert namespace["missed"].any() and namespace["error_centred"] < namespace["error_far"]
    with capsys.disabled():
        per_block = ", ".join(f"l.{n} {t:.1f}s" for n, t in timings)
        print(f"\ncookbook: {len(timings)} blocks in {sum(t for _, t in timings):.1f} s: {per_block}")
