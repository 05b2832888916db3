"""A griffe extension for the API pages: reST roles in docstrings become Markdown.

The docstrings use reST inline roles (``:func:`chunkop.vmap```, ``:class:`RowOperator```), which
mkdocstrings' Google-style parser leaves as literal text. Before rendering, a role naming a
public object of ``chunkop`` becomes a cross-reference (``[`chunkop.vmap`][chunkop.vmap]``,
resolved by mkdocs-autorefs to the object's entry on the API page); any other role becomes
inline code. Loaded by ``mkdocs.yml`` (``extensions: [docs/griffe_roles.py]``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|obj|data):`~?([^`]+)`")
_PUBLIC = {
    "vmap",
    "map",
    "sum",
    "mean",
    "jacrev",
    "jacfwd",
    "RowOperator",
    "TransposedRowOperator",
    "check_linear",
    "gram_diagonal",
    "to_scipy",
}


def roles_to_markdown(text: str) -> str:
    """``:func:`chunkop.vmap``` -> ``[`chunkop.vmap`][chunkop.vmap]``; other roles -> ```name```."""

    def replace(m: re.Match) -> str:
        name = m.group(1)
        short = name.removeprefix("chunkop.")
        if short.split(".")[0] in _PUBLIC:
            return f"[`{name}`][chunkop.{short}]"
        return f"`{name}`"

    return _ROLE.sub(replace, text)


class RolesToMarkdown(griffe.Extension):
    """Rewrite reST roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = roles_to_markdown(obj.docstring.value)
