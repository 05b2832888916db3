"""The documentation site builds: ``mkdocs build --strict`` (mkdocs-material, API pages rendered
from the docstrings by mkdocstrings) passes, and the API page documents every public name with
its arguments and cross-links. Skipped when the ``docs`` extra is not installed."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import chunkop

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _text(path: Path) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", path.read_text())))


def _letters(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", re.sub(r":(func|class|meth|attr):", "", s))


def test_every_page_is_built(site):
    for page in ("index.html", "guide/index.html", "design/index.html", "nifty/index.html", "api/index.html"):
        assert (site / page).is_file(), page


def test_api_page_renders_the_docstrings(site):
    raw = (site / "api" / "index.html").read_text()
    text = _text(site / "api" / "index.html")
    for name in chunkop.__all__:
        if name == "__version__":
            continue
        assert f'id="chunkop.{name}"' in raw, f"no entry for chunkop.{name}"
        # the docstring's summary line, compared letters only (markup and spacing differ)
        summary = _letters(getattr(chunkop, name).__doc__.split("\n\n")[0])
        assert summary[:40] in _letters(text), name
    # arguments come from the Args sections, examples from the Example sections
    assert "chunk_size" in text and "progress" in text and "Returns" in text
    assert ">>>" in raw or "&gt;&gt;&gt;" in raw or "chunkop.vmap(lambda x, w" in text
    # reST roles became cross-references, none left as literal text
    assert ":func:" not in text and ":class:" not in text
    assert 'href="#chunkop.vmap"' in raw


def test_roles_extension():
    spec = importlib.util.spec_from_file_location("griffe_roles", ROOT / "docs" / "griffe_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    convert = module.roles_to_markdown
    assert convert("see :func:`chunkop.vmap`.") == "see [`chunkop.vmap`][chunkop.vmap]."
    assert convert(":class:`RowOperator` and :class:`~chunkop.RowOperator`") == (
        "[`RowOperator`][chunkop.RowOperator] and [`chunkop.RowOperator`][chunkop.RowOperator]"
    )
    assert convert("a :func:`_private_helper`") == "a `_private_helper`"
    assert convert("no roles") == "no roles"
