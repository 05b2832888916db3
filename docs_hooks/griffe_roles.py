"""A griffe extension for the API pages: docstrings written for ``help()`` become Markdown.

Loaded by ``mkdocs.yml`` (``extensions: [docs_hooks/griffe_roles.py:RolesToMarkdown]``). It lives
outside ``docs/`` so that it is not published with the site. Before mkdocstrings renders a
docstring, two rewrites run on its text:

- **reST roles.** ``:func:`chunkop.vmap``` and ``:class:`RowOperator``` are left as literal text
  by the Google-style parser. A role naming a public object of ``chunkop`` becomes a
  cross-reference (``[`chunkop.vmap`][chunkop.vmap]``, resolved by mkdocs-autorefs to the
  object's entry on the API page); any other role becomes inline code.
- **Doctest examples.** A ``>>>`` session is plain text to Markdown: its prompts open nested
  blockquotes and its lines are reflowed into one paragraph. Every ``>>>`` session (the prompt
  lines, their ``...`` continuations and the expected output, up to a blank line or a dedent)
  is wrapped in a ```` ```pycon ```` fence, so it renders as a highlighted code block (the
  ``Example:`` admonition around it stays). The docstring itself is unchanged for ``help()``
  and ``doctest``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|obj|data):`~?([^`]+)`")
_INIT = Path(__file__).resolve().parents[1] / "src" / "chunkop" / "__init__.py"


def _public_names() -> set[str]:
    """``chunkop.__all__``, read from the package's ``__init__.py`` without importing it (jax)."""
    for node in ast.parse(_INIT.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value)) - {"__version__"}
    raise RuntimeError(f"no __all__ in {_INIT}")


_PUBLIC = _public_names()
_PROMPT = re.compile(r"^([ \t]*)>>>(?: |$)")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_DIRECTIVE = re.compile(r"[ \t]*#[ \t]*doctest:.*$")


def roles_to_markdown(text: str) -> str:
    """``:func:`chunkop.vmap``` -> ``[`chunkop.vmap`][chunkop.vmap]``; other roles -> ```name```."""

    def replace(m: re.Match) -> str:
        name = m.group(1)
        short = name.removeprefix("chunkop.")
        if short.split(".")[0] in _PUBLIC:
            return f"[`{name}`][chunkop.{short}]"
        return f"`{name}`"

    return _ROLE.sub(replace, text)


def doctests_to_fences(text: str) -> str:
    """Wrap every ``>>>`` session of ``text`` in a ```` ```pycon ```` fence at the prompt's indent.

    A session ends at a blank line or at a line indented less than its first prompt (doctest's own
    rule for where the expected output stops). Sessions already inside a fence are left alone;
    ``# doctest:`` directives are dropped from the rendered copy.
    """
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None  # the marker of the fence we are inside, if any
    i = 0
    while i < len(lines):
        line = lines[i]
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
            out.append(line)
            i += 1
            continue
        if opened:
            fence = opened.group(1)
            out.append(line)
            i += 1
            continue
        prompt = _PROMPT.match(line)
        if prompt is None:
            out.append(line)
            i += 1
            continue
        indent = prompt.group(1)
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            out.append(_DIRECTIVE.sub("", lines[i]))
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class RolesToMarkdown(griffe.Extension):
    """Rewrite reST roles and doctest sessions in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = doctests_to_fences(roles_to_markdown(obj.docstring.value))
