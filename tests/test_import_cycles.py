"""The module graph of the project's packages has no cycle, hidden ones included.

import-linter (``make lint``) checks the arrows between packages and rooms; a cycle inside
one room passes it, and an import inside a function or a ``TYPE_CHECKING`` block hides a
cycle from Python itself (neither side fails to import). This test reads every module's
AST, takes every import of a project module wherever it stands, and fails on any cycle,
naming its modules and the lines that close it.

An edge goes to the module imported: ``from a.b import c`` reaches ``a.b.c`` when that is
a module, else ``a.b`` (its ``__init__``, which is a module like any other: a submodule
importing its package's facade while the facade imports it is a cycle too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("blobstore", "identity", "p2p", "training")

# Cycles being removed in other branches now; each entry is the edge (importer, imported)
# left out of the graph. The lead removes an entry when its cycle is gone (the test then
# holds it gone).
KNOWN: frozenset[tuple[str, str]] = frozenset()

Graph = dict[str, dict[str, int]]  # module -> imported module -> first line


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(name: str) -> bool:
    return (REPO / name.replace(".", "/") / "__init__.py").exists()


def exists(name: str) -> bool:
    return is_package(name) or (REPO / (name.replace(".", "/") + ".py")).exists()


def imports(path: Path, name: str) -> Iterator[tuple[str, int]]:
    """(imported project module, line) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                yield (child if exists(child) else target), node.lineno


def build_graph(root: Path = REPO) -> Graph:
    graph: Graph = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path)
            edges = graph.setdefault(name, {})
            for target, line in imports(path, name):
                if target == name or (name, target) in KNOWN:
                    continue
                edges.setdefault(target, line)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: Graph, component: list[str]) -> str:
    inside = set(component)
    arrows = [
        f"  {a} -> {b} (line {line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in inside
    ]
    return "\n".join([" <-> ".join(component), *arrows])


def test_the_module_graph_has_no_cycle() -> None:
    graph = build_graph()
    assert len(graph) > 100  # the walk found the packages
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_a_hidden_cycle_is_found() -> None:
    """Guards the test above: a function-level import back (the kind the test exists
    for) is a cycle."""
    graph = {
        "blobstore.a": {"blobstore.b": 3},
        "blobstore.b": {"blobstore.c": 5},
        "blobstore.c": {"blobstore.a": 9},
        "blobstore.d": {"blobstore.a": 1},
    }
    assert cycles(graph) == [["blobstore.a", "blobstore.b", "blobstore.c"]]
