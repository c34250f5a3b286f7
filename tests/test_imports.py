"""No import cycles among flashkiln's modules (CPU only, parses the sources with ast).

Every import counts, at module level or inside a function (a function-level import only hides a
cycle until the call); imports under `if TYPE_CHECKING:` do not, since they never run. Importing
a submodule also runs its parent packages' __init__, but that is no edge here: a package that
imports its submodules would otherwise be in a cycle with each of them.
"""
from __future__ import annotations

import ast
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
# Package -> its source directory (pyproject.toml's package-dir).
ROOTS = {"flashkiln": REPO / "runtime", "flashkiln.generator": REPO / "generator"}


def _modules() -> dict[str, Path]:
    """Every module of both packages by dotted name (a package by its __init__.py)."""
    modules = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that `module` (parsed as `tree`) imports."""
    edges: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from m import sub` imports the submodule; `from m import name` reads m itself.
                sub = f"{base}.{alias.name}"
                edges.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return (edges & modules) - {module}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of flashkiln it imports."""
    modules = _modules()
    return {name: _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", set(modules))
            for name, path in modules.items()}


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each one's modules
    all import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """A shortest cycle from `start` back to it (breadth-first), as [start, ..., start]; [] if none."""
    parent = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    return []


def _report(graph: dict[str, set[str]], found: list[set[str]]) -> str:
    """Each component's shortest cycle through each of its modules, once each."""
    lines = []
    for component in found:
        seen = set()
        for module in sorted(component):
            cycle = shortest_cycle(graph, module)[:-1]
            first = cycle.index(min(cycle))
            rotated = tuple(cycle[first:] + cycle[:first])
            if rotated not in seen:
                seen.add(rotated)
                lines.append("  " + " -> ".join(rotated + (rotated[0],)))
    return "import cycles:\n" + "\n".join(lines)


def _in_generator(module: str) -> bool:
    return module == "flashkiln.generator" or module.startswith("flashkiln.generator.")


def test_generator_has_no_import_cycle():
    graph = import_graph()
    found = [c for c in components(graph) if all(_in_generator(m) for m in c)]
    assert not found, _report(graph, found)


# Cycles through both packages count here: each goes through the runtime's __init__.
def test_runtime_has_no_import_cycle():
    graph = import_graph()
    found = [c for c in components(graph) if not all(_in_generator(m) for m in c)]
    assert not found, _report(graph, found)


def test_graph_sees_function_level_imports_and_skips_type_checking():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\nelse:\n    import c\n"
              "def f():\n    from .d import x\n")
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "c"}
    assert _imported(ast.parse(source), "p.a", False, modules) == {"c", "p.d"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert components(graph) == [{"a", "b", "c"}]
    assert shortest_cycle(graph, "b") == ["b", "c", "a", "b"] and shortest_cycle(graph, "d") == []
