"""The documentation site builds: ``mkdocs build --strict`` (mkdocs-material, API pages rendered
from the docstrings by mkdocstrings) passes, and the API page documents every public name with
its arguments and cross-links, and shows every docstring example as a highlighted code block
(the built HTML is parsed: ``mkdocs build --strict`` passes even when a ``>>>`` session is
rendered as nested blockquotes). Skipped when the ``docs`` extra is not installed."""

from __future__ import annotations

import doctest
import html
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import chunkop

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [name for name in chunkop.__all__ if name != "__version__"]


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
    pages = ("index.html", "guide/index.html", "cookbook/index.html", "design/index.html", "nifty/index.html")
    for page in (*pages, "api/index.html"):
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
    # reST roles became cross-references, none left as literal text
    assert ":func:" not in text and ":class:" not in text
    assert 'href="#chunkop.vmap"' in raw


def test_no_python_source_is_published(site):
    """The griffe extension (docs_hooks/) and other build helpers are not part of the site."""
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*.py")) == []


# ------------------------------------------------------------------------------------------------
# Docstring examples on the API page, read from the built HTML.

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Page(HTMLParser):
    """Collects, from one HTML page: every text node with the tags around it, the text of every
    ``<pre>`` (with the entry, i.e. the last ``id="chunkop..."`` heading, it belongs to, whether
    it sits in a ``div.highlight`` and whether Pygments marked prompts in it), and the text of
    every ``<blockquote>``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict]] = []
        self.texts: list[tuple[str, tuple[str, ...]]] = []
        self.pres: list[dict] = []
        self.quotes: list[str] = []
        self.entry: str | None = None
        self._open_pre: dict | None = None
        self._open_quotes: list[list[str]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in {"h1", "h2", "h3", "h4", "h5"} and (attrs.get("id") or "").startswith("chunkop."):
            self.entry = attrs["id"]
        if tag == "pre" and self._open_pre is None:
            highlighted = any(t == "div" and "highlight" in (a.get("class") or "").split() for t, a in self.stack)
            self._open_pre = {"entry": self.entry, "text": [], "highlighted": highlighted, "prompts": False}
        if tag == "span" and self._open_pre is not None and attrs.get("class") == "gp":
            self._open_pre["prompts"] = True
        if tag == "blockquote":
            self._open_quotes.append([])
        if tag not in _VOID:
            self.stack.append((tag, attrs))

    def handle_endtag(self, tag):
        if tag in _VOID:
            return
        while self.stack:  # tolerate unclosed inner tags
            open_tag, _ = self.stack.pop()
            if open_tag == "pre" and self._open_pre is not None:
                self._open_pre["text"] = "".join(self._open_pre["text"])
                self.pres.append(self._open_pre)
                self._open_pre = None
            if open_tag == "blockquote" and self._open_quotes:
                self.quotes.append("".join(self._open_quotes.pop()))
            if open_tag == tag:
                break

    def handle_data(self, data):
        self.texts.append((data, tuple(t for t, _ in self.stack)))
        if self._open_pre is not None:
            self._open_pre["text"].append(data)
        for quote in self._open_quotes:
            quote.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    page.close()
    return page


_DIRECTIVE = re.compile(r"[ \t]*#[ \t]*doctest:.*$", re.MULTILINE)


def _session_lines(docstring: str) -> list[str]:
    """The lines a docstring's doctest session shows: ``>>> `` / ``... `` source, then output."""
    lines = []
    for example in doctest.DocTestParser().get_examples(docstring):
        source = _DIRECTIVE.sub("", example.source).rstrip("\n").split("\n")
        lines += [">>> " + source[0]] + ["... " + s for s in source[1:]]
        lines += example.want.rstrip("\n").split("\n") if example.want else []
    return [" ".join(line.split()) for line in lines if line.strip()]


def test_every_doctest_prompt_on_the_api_page_is_code(site):
    page = _parse(site / "api" / "index.html")
    prompts = [(data, tags) for data, tags in page.texts if ">>>" in data]
    assert prompts, "no >>> on the API page: the docstring examples are not rendered as text at all"
    for data, tags in prompts:
        assert "pre" in tags or "code" in tags, f"a >>> outside a code block: {data!r} in {tags}"
        assert "blockquote" not in tags, f"a >>> inside a blockquote: {data!r}"


def test_no_docstring_example_is_rendered_as_a_blockquote(site):
    """Markdown reads ``>>>`` as three nested blockquotes: the example's code would end up as the
    quote's text (with the prompts gone, so a search for ``>>>`` alone would miss it)."""
    page = _parse(site / "api" / "index.html")
    quoted = " ".join(" ".join(q.split()) for q in page.quotes)
    for name in PUBLIC:
        for line in _session_lines(getattr(chunkop, name).__doc__):
            code = line.removeprefix(">>> ").removeprefix("... ")
            assert len(code) < 12 or code not in quoted, f"chunkop.{name}: {code!r} rendered inside a <blockquote>"


@pytest.mark.parametrize("name", [n for n in chunkop.__all__ if n != "__version__"])
def test_each_public_example_is_a_highlighted_code_block(site, name):
    page = _parse(site / "api" / "index.html")
    expected = _session_lines(getattr(chunkop, name).__doc__)
    assert expected, f"chunkop.{name} has no docstring example"
    blocks = [p for p in page.pres if p["entry"] == f"chunkop.{name}"]
    shown = "\n".join(" ".join(line.split()) for p in blocks for line in p["text"].split("\n"))
    for line in expected:
        assert line in shown, f"chunkop.{name}: example line {line!r} is not in a code block of its entry"
    first = next(p for p in blocks if expected[0] in " ".join(p["text"].split()))
    assert first["highlighted"] and first["prompts"], f"chunkop.{name}: the example is not a highlighted pycon block"


def test_examples_copy_without_prompts(site):
    """The copy button of a pycon block copies code only: the stylesheet hiding Pygments' prompt
    (.gp) and output (.go) tokens while Material copies is shipped and linked from the API page."""
    css = (site / "stylesheets" / "doctest.css").read_text()
    assert re.search(r"\[data-md-copying\] \.gp,\s*\[data-md-copying\] \.go\s*\{\s*display: none;", css)
    assert 'href="../stylesheets/doctest.css"' in (site / "api" / "index.html").read_text()


def test_page_parser_sees_a_blockquoted_session():
    """The checks above can fail: the markup Markdown makes of an unfenced ``>>>`` session is caught."""
    page = _Page()
    page.feed("<blockquote><blockquote><blockquote><p>import jax\nf(1)\n2</p></blockquote></blockquote>")
    page.feed("</blockquote><div class='highlight'><pre><code>")
    page.feed("<span class='gp'>&gt;&gt;&gt; </span>f(1)</code></pre></div>")
    page.close()
    assert page.quotes and "f(1)" in page.quotes[-1]
    assert [p["text"] for p in page.pres] == [">>> f(1)"] and page.pres[0]["highlighted"]
    assert [tags for data, tags in page.texts if ">>>" in data] == [("div", "pre", "code", "span")]


def _extension():
    path = ROOT / "docs_hooks" / "griffe_roles.py"
    spec = importlib.util.spec_from_file_location("griffe_roles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctest_fences():
    convert = _extension().doctests_to_fences
    text = "Example:\n    >>> f(1,\n    ...   2)\n    3\n    >>> g()\n\n    Text after.\nEnd"
    assert convert(text) == (
        "Example:\n    ```pycon\n    >>> f(1,\n    ...   2)\n    3\n    >>> g()\n    ```\n\n    Text after.\nEnd"
    )
    # a dedent ends the session; a session inside a fence is left alone; directives are dropped
    assert convert("  >>> x  # doctest: +ELLIPSIS\n  1\nNext") == "  ```pycon\n  >>> x\n  1\n  ```\nNext"
    fenced = "```pycon\n>>> x\n1\n```"
    assert convert(fenced) == fenced
    assert convert("a >>> b\n>>>x") == "a >>> b\n>>>x"  # not a prompt: mid-line, or no space after


def test_roles_extension_knows_every_public_name():
    """A role naming a public object becomes a cross-reference only if the extension lists it."""
    assert set(PUBLIC) == _extension()._PUBLIC


def test_roles_extension():
    convert = _extension().roles_to_markdown
    assert convert("see :func:`chunkop.vmap`.") == "see [`chunkop.vmap`][chunkop.vmap]."
    assert convert(":class:`RowOperator` and :class:`~chunkop.RowOperator`") == (
        "[`RowOperator`][chunkop.RowOperator] and [`chunkop.RowOperator`][chunkop.RowOperator]"
    )
    assert convert("a :func:`_private_helper`") == "a `_private_helper`"
    assert convert("no roles") == "no roles"
