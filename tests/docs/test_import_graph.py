"""Both packages' import graphs, read from the sources: no cycle anywhere, and the runtime imports no tool.

Edges are every import statement (module level or inside a function; not those under
``if TYPE_CHECKING:``, which never run) from a module of
``megatron_gift`` or ``megatron_gift_tools`` to another module of either; ``from pkg import name``
counts as an edge to ``pkg.name`` where that is a module. docs/how-it-works.md states the layering
these tests keep true.
"""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_gift_tools.layering import layer_of, layers

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"megatron_gift": ROOT / "megatron_gift", "megatron_gift_tools": ROOT / "tools" / "megatron_gift_tools"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (pkg, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> modules of either package it imports`` (see the module doc)."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            for t in targets:
                while t and t not in modules:  # import a.b.c of a package: the deepest module named
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init_edge(a: str, b: str, modules: dict[str, Path]) -> bool:
    return modules[a].name == "__init__.py" and b.startswith(a + ".")


def test_no_import_cycle_in_either_package():
    """A cycle (the tools had bench <-> planner, bench <-> demo, planner.cli <-> cli) means no module of it
    can be read, tested or moved alone, and a module-level import in one of them can fail half-initialised.
    A package's ``__init__`` re-exporting its own submodules is not a cycle."""
    modules = _modules()
    graph = import_graph(modules)
    graph = {a: {b for b in bs if not _is_package_init_edge(a, b, modules)} for a, bs in graph.items()}
    assert cycles(graph) == []


def test_runtime_imports_no_tool():
    """The runtime (every module of ``megatron_gift``) ships to training jobs without the tools."""
    graph = import_graph(_modules())
    bad = sorted(
        (a, b)
        for a, bs in graph.items()
        if a.startswith("megatron_gift.") or a == "megatron_gift"
        for b in bs
        if b.startswith("megatron_gift_tools")
    )
    assert bad == []


def test_runtime_tests_import_no_tool():
    """Tests of the runtime (everything but ``tests/tools``, ``tests/docs`` and the tools' own tests) import
    no tool: a runtime test that needs a benchmark to run would break when the tools are not installed."""
    tool_tests = {"tools", "docs"}
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT / "tests")
        if rel.parts[0] in tool_tests:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{rel}: {n}" for n in names if n.split(".")[0] == "megatron_gift_tools"]
    assert bad == []


def test_cycle_finder_sees_a_cycle():
    """A finder that returned nothing would pass the test above on any graph."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def upward_imports(graph: dict[str, set[str]], table: list[tuple[str, ...]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if layer_of(b, table) < layer_of(a, table))


def test_imports_only_go_down_the_documented_layers():
    """docs/how-it-works.md's layer list is the layering a maintainer reads; an import running up it (the
    CPU harness importing test support, a kernel importing the reduction) makes the doc false."""
    assert upward_imports(import_graph(_modules()), layers()) == []


def test_layer_check_sees_an_upward_import():
    """A check that never flagged anything would keep the test above green whatever the code did."""
    table = [("a",), ("b", "c"), ("d",)]
    assert upward_imports({"a.x": {"b.y"}, "b.y": {"c", "d.z"}, "d.z": {"a.x"}}, table) == ["d.z -> a.x"]
