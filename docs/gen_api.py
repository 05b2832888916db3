"""Generate ``docs/api.md``, the API reference, from the docstrings of ``chunkop.__all__``.

Usage::

    python docs/gen_api.py            # (re)write docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date
    python docs/gen_api.py --stdout   # print the reference instead of writing it

For every public name it emits the signature and the docstring as Markdown: Google-style
sections (``Args:``, ``Returns:``, ``Raises:``, ``Example:``) become bold headers, argument
lists become bullet lists, doctest examples become ``pycon`` code blocks, and reST inline
markup (````code````, ``:func:`name```) becomes Markdown (links for public names). Classes also
list the members defined by chunkop (methods and properties, with their docstrings) and those
inherited from lineax. The output depends only on the docstrings and signatures, so
``tests/test_docs.py`` can check that the committed file is up to date.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import chunkop

API_MD = Path(__file__).resolve().parent / "api.md"
WIDTH = 88
SECTIONS = {
    "Args": "Args",
    "Arguments": "Args",
    "Returns": "Returns",
    "Raises": "Raises",
    "Yields": "Yields",
    "Example": "Example",
    "Examples": "Example",
    "Note": "Note",
    "Notes": "Note",
}
_HEADER = re.compile(r"^(%s):\s*$" % "|".join(SECTIONS))
_ITEM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)(\s*\([^)]*\))?:\s*(.*)$")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|obj|data):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def public_names() -> list[str]:
    return [name for name in chunkop.__all__ if name != "__version__"]


def anchor(title: str) -> str:
    """GitHub's anchor for a heading whose text is ``title`` (backticks stripped)."""
    text = title.strip().lower().replace(" ", "-")
    return re.sub(r"[^\w\- ]", "", text)


def _link_target(name: str) -> str | None:
    short = name[len("chunkop.") :] if name.startswith("chunkop.") else name
    head = short.split(".")[0]
    if head not in public_names():
        return None
    return anchor(f"chunkop.{short}") if short == head else anchor(short)


def inline(text: str) -> str:
    """reST inline markup to Markdown: ``code`` -> `code`, :func:`x` -> a link or `x`."""

    def role(m: re.Match) -> str:
        name = m.group(1)
        target = _link_target(name)
        return f"[`{name}`](#{target})" if target else f"`{name}`"

    text = _ROLE.sub(role, text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _items(lines: list[str]) -> list[tuple[str, str]]:
    """``name: text`` items of an Args/Raises section; deeper-indented lines continue an item."""
    body = [ln for ln in lines if ln.strip()]
    if not body:
        return []
    base = _indent(body[0])
    items: list[list[str]] = []
    for ln in body:
        m = _ITEM.match(ln.strip())
        if _indent(ln) <= base and m:
            items.append([m.group(1) + (m.group(2) or ""), m.group(3)])
        elif items:
            items[-1][1] += " " + ln.strip()
        else:  # no item syntax: keep the text
            items.append(["", ln.strip()])
    return [(name, text) for name, text in items]


def _section(kind: str, lines: list[str]) -> list[str]:
    out = [f"**{kind}:**", ""]
    if kind in ("Args", "Raises"):
        for name, text in _items(lines):
            out.append(f"- `{name}`: {inline(text)}" if name else f"- {inline(text)}")
    elif kind == "Example":
        out.extend(_fenced(textwrap.dedent("\n".join(lines)).strip("\n").splitlines()))
    else:
        out.extend(_paragraphs(textwrap.dedent("\n".join(lines)).strip("\n").splitlines()))
    out.append("")
    return out


def _fenced(lines: list[str]) -> list[str]:
    return ["```pycon", *[ln.rstrip() for ln in lines], "```"]


def _paragraphs(lines: list[str]) -> list[str]:
    """Free text: inline markup converted; doctest runs (``>>>`` up to a blank line) fenced."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith(">>>"):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out.extend(_fenced(textwrap.dedent("\n".join(lines[i:j])).splitlines()))
            i = j
            continue
        out.append(inline(lines[i].rstrip()))
        i += 1
    return out


def docstring_md(doc: str | None) -> list[str]:
    """A docstring as Markdown lines (empty for ``None``)."""
    if not doc:
        return []
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    text: list[str] = []
    i = 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if not m:
            text.append(lines[i])
            i += 1
            continue
        out.extend(_paragraphs(text))
        text = []
        if out and out[-1].strip():
            out.append("")
        j = i + 1
        while j < len(lines) and not _HEADER.match(lines[j]) and (
            not lines[j].strip() or _indent(lines[j]) > 0 or i == 0
        ):
            j += 1
        out.extend(_section(SECTIONS[m.group(1)], lines[i + 1 : j]))
        i = j
    out.extend(_paragraphs(text))
    while out and not out[-1].strip():
        out.pop()
    return out


def _annotation(ann: Any) -> str:
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _param(p: inspect.Parameter) -> str:
    prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    s = prefix + p.name
    if p.annotation is not p.empty:
        s += f": {_annotation(p.annotation)}"
    if p.default is not p.empty:
        s += (" = " if p.annotation is not p.empty else "=") + _ADDRESS.sub("", repr(p.default))
    return s


def signature(name: str, obj: Any, *, drop_self: bool = False, returns: bool = True) -> list[str]:
    """``name(params) -> ret`` in a ``text`` block, one parameter per line when long."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts: list[str] = []
    star_done = any(p.kind is p.VAR_POSITIONAL for p in params)
    for k, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        parts.append(_param(p))
        nxt = params[k + 1] if k + 1 < len(params) else None
        if p.kind is p.POSITIONAL_ONLY and (nxt is None or nxt.kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = ""
    if returns and sig.return_annotation is not sig.empty:
        ret = f" -> {_annotation(sig.return_annotation)}"
    one = f"{name}({', '.join(parts)}){ret}"
    if len(one) <= WIDTH:
        text = [one]
    else:
        text = [f"{name}(", *[f"    {p}," for p in parts], f"){ret}"]
    return ["```text", *text, "```"]


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """Public methods/properties defined by chunkop classes in ``cls``'s MRO (first wins)."""
    seen: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("chunkop"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(value, property) or inspect.isfunction(value):
                seen[name] = value
    return list(seen.items())


def _inherited(cls: type, covered: set[str]) -> list[str]:
    """Public members that ``cls`` gets from non-chunkop bases (e.g. lineax), not overridden."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass.__module__.startswith(("chunkop", "builtins", "collections", "equinox", "abc")):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in covered or name in names:
                continue
            if isinstance(value, property) or callable(value):
                names.append(name)
    return names


def _member_ref(name: str, value: Any) -> str:
    return f"`{name}`" if isinstance(value, property) else f"`{name}()`"


def render_class(name: str, cls: type) -> list[str]:
    out = [f"## `chunkop.{name}`", ""]
    out += signature(f"chunkop.{name}", cls, returns=False) + [""]
    out += docstring_md(cls.__doc__) + [""]
    init = vars(cls).get("__init__")
    if init is not None and init.__doc__ and init.__doc__ != object.__init__.__doc__:
        out += ["**Constructor.**", ""] + docstring_md(init.__doc__) + [""]
    if dataclasses.is_dataclass(cls):
        fields = [
            f"`{f.name}`" + (" (static)" if f.metadata.get("static") else "")
            for f in dataclasses.fields(cls)
        ]
        out += [f"**Fields:** {', '.join(fields)}.", ""]
    members = _own_members(cls)
    undocumented = []
    for mname, value in members:
        doc = (value.fget if isinstance(value, property) else value).__doc__
        if not doc:
            undocumented.append(_member_ref(mname, value))
            continue
        if isinstance(value, property):
            out += [f"### `{name}.{mname}`", "", "*property*", ""]
        else:
            out += [f"### `{name}.{mname}`", ""]
            out += signature(f"{name}.{mname}", value, drop_self=True) + [""]
        out += docstring_md(doc) + [""]
    if undocumented:
        out += [f"**Other members** (no docstring): {', '.join(undocumented)}.", ""]
    inherited = _inherited(cls, {m for m, _ in members})
    if inherited:
        bases = [k for k in cls.__mro__ if k.__module__.startswith("lineax")]
        base = f"{bases[0].__module__.split('.')[0]}.{bases[0].__name__}" if bases else "its bases"
        refs = ", ".join(f"`{m}`" for m in inherited)
        out += [f"**Inherited from `{base}`:** {refs}.", ""]
    return out


def render_function(name: str, fun: Any) -> list[str]:
    out = [f"## `chunkop.{name}`", ""]
    out += signature(f"chunkop.{name}", fun) + [""]
    out += docstring_md(fun.__doc__) + [""]
    return out


def _summary(obj: Any) -> str:
    doc = inspect.cleandoc(obj.__doc__ or "")
    return inline(doc.split("\n\n")[0].replace("\n", " ")) if doc else ""


def render() -> str:
    """The full text of ``docs/api.md``."""
    out = [
        "<!-- Generated by docs/gen_api.py from the docstrings; do not edit by hand. -->",
        "<!-- Regenerate with: python docs/gen_api.py -->",
        "",
        "# API reference",
        "",
        f"`chunkop` {chunkop.__version__}. Everything below is importable as `chunkop.<name>`; "
        "the [user guide](guide.md) shows how the pieces fit together and the "
        "[design note](design.md) how they work.",
        "",
    ]
    for name in public_names():
        out.append(f"- [`chunkop.{name}`](#{anchor('chunkop.' + name)}): {_summary(getattr(chunkop, name))}")
    out.append("")
    for name in public_names():
        obj = getattr(chunkop, name)
        out += render_class(name, obj) if inspect.isclass(obj) else render_function(name, obj)
    out += ["## `chunkop.__version__`", "", f"The package version, `{chunkop.__version__!r}`.", ""]
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    group.add_argument("--stdout", action="store_true", help="print instead of writing docs/api.md")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = API_MD.read_text() if API_MD.exists() else ""
        if current != text:
            print(f"{API_MD} is out of date; run: python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(text)
    print(f"wrote {API_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
