"""The package's structure, as ``docs/design.md`` describes it: one engine below the operator
layer, imports that only go down, and JAX's internals read in one module.

These read the source (``ast``); nothing is imported or run.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "chunkop"


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (``chunkop._trace``, ``chunkop._operator.kernels`` ...)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package's modules ``name`` imports, at any depth of its source (inside functions too)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                bases = [node.module or ""]
            else:
                bases = [".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))]
            for base in bases:
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    found.add(candidate if candidate in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_graph_reads_the_imports():
    """A guard on the reader itself: known edges are found (a function-level import among them)."""
    assert "chunkop._jaxpr" in GRAPH["chunkop._trace"]
    assert "chunkop._operator.kernels" in GRAPH["chunkop._operator.row_operator"]
    assert "chunkop._budget" in GRAPH["chunkop._transform"]
    assert len(GRAPH) >= 25


def test_imports_only_go_down():
    """The modules' imports form no cycle: every module sits above the ones it imports (no
    module imports upward, lazily or not)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("an import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_engine_does_not_import_the_operator_layer():
    """The transforms' engine (every ``chunkop._*`` module outside ``_operator``) never reaches
    into the operator layer, which is built on it."""
    engine = [m for m in MODULES if m.count(".") == 1 and m != "chunkop._operator"]
    for m in engine:
        up = sorted(d for d in GRAPH[m] if d.startswith("chunkop._operator"))
        assert not up, f"{m} imports {up}"


_INTERNAL = re.compile(
    r"jax\._src|jax\.interpreters|type\([^()]*\)\.__name__\s*(==|!=|in\b|not in\b|\.startswith)"
    r"|__module__[^\n]*startswith"
)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m != "chunkop._jaxpr"))
def test_jax_internals_are_read_in_one_module(name):
    """Only ``chunkop._jaxpr`` imports ``jax._src`` or ``jax.interpreters`` (JAX's rule tables)
    or recognises one of JAX's classes by name: when JAX changes them, one module changes."""
    hits = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(MODULES[name].read_text().splitlines(), 1)
        if _INTERNAL.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, f"{name} reads JAX's internals (move it to chunkop._jaxpr):\n" + "\n".join(hits)


def test_the_internals_pattern_catches_what_it_forbids():
    """A guard on the pattern: the forms it must reject are rejected."""
    for line in (
        "from jax._src import core",
        "from jax.interpreters import ad, batching, mlir",
        'if type(x).__name__ == "BatchTracer":',
        'while type(t).__name__ in ("JVPTracer",):',
        'if (type(v).__module__ or "").startswith("jax."):',
    ):
        assert _INTERNAL.search(line), line
    assert not _INTERNAL.search('raise TypeError(f"got {type(x).__name__}")')


def _module_map() -> list[str]:
    """The modules of ``docs/design.md``'s module map, in the table's order (dotted names)."""
    text = (SRC.parent.parent / "docs" / "design.md").read_text()
    table = text[text.index("## Module map") :]
    table = table[: table.index("\n## ", 1)]
    names = []
    for cell in re.findall(r"^\| `([\w/]+)\.py` \|", table, flags=re.M):
        parts = ["chunkop", *cell.split("/")]
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_module_map_is_in_import_order():
    """``docs/design.md`` says: a module imports only modules below it in the module map. Every
    module is in the map once, and each one's imports sit below it."""
    order = _module_map()
    assert sorted(order) == sorted(MODULES), set(order) ^ set(MODULES)
    position = {m: i for i, m in enumerate(order)}
    upward = [f"{m} imports {d}" for m in order for d in sorted(GRAPH[m]) if position[d] < position[m]]
    assert not upward, "imports above their module in design.md's map: " + "; ".join(upward)
