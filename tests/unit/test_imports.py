"""The modules under proxy/ import each other in no circle, and product code never imports the simulators.

Every import counts: module level, inside functions, under `if TYPE_CHECKING:`, and the package
`__init__` an import of a submodule runs first (but a module's own packages: their `__init__` may
re-export it). A circle means two modules cannot be understood,
tested or replaced one without the other (the admin features and the service were one such knot).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.unit.source_tree import source_file

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    line: int
    module_level: bool  # False: inside a function (runs only when called)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "proxy").rglob("*.py"))}


def _known(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolve against the importing module's package
            package = source if is_package else source.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        target = _known(name, known) if name.split(".")[0] == "proxy" else None
        while target:  # the module, and every package __init__ on the way to it but the importer's own
            if not source.startswith(target + "."):  # (a package re-exporting its own modules is its face)
                out.append(target)
            target = _known(target.rpartition(".")[0], known)
    return out


def _imports(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `node`, and whether it sits inside a function (one walk)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        else:
            yield from _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


@functools.cache  # the package's files do not change during a run; two tests read the same graph
def _edges_of(root: Path) -> tuple[Edge, ...]:
    known = modules(root)
    edges: list[Edge] = []
    for source, path in known.items():
        for node, in_function in _imports(source_file(path).tree):
            for target in _targets(node, source, path.name == "__init__.py", known):
                if target != source and target != "proxy":
                    edges.append(Edge(source, target, node.lineno, not in_function))
    return tuple(edges)


def import_edges(root: Path = ROOT) -> list[Edge]:
    return list(_edges_of(root))


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


# Circles known and left to their owners, each with why; the test fails on any other, and when one
# of these is gone (then delete its line here).
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def test_modules_under_proxy_import_each_other_in_no_circle() -> None:
    edges = import_edges()
    assert len(edges) > 100, f"the walk found only {len(edges)} imports: it is not reading the package"
    found = [c for c in cycles(edges) if tuple(c) not in KNOWN_CIRCLES]
    detail = "\n".join(f"{e.source}:{e.line} -> {e.target}" for e in edges
                       if any(e.source in c and e.target in c for c in found))
    assert not found, f"import circles: {found}\n{detail}"
    gone = KNOWN_CIRCLES - {tuple(c) for c in cycles(edges)}
    assert not gone, f"these circles are gone: remove them from KNOWN_CIRCLES: {gone}"


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "proxy"
    (pkg / "admin").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "admin" / "__init__.py").write_text("")
    (pkg / "service.py").write_text("from proxy.admin.ext import x\n")
    (pkg / "admin" / "ext.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from proxy.service import Proxy\n")
    (pkg / "admin" / "lazy.py").write_text("def f():\n    from . import ext\n")
    edges = import_edges(tmp_path)
    assert cycles(edges) == [["proxy.admin.ext", "proxy.service"]], edges
    lazy = [e for e in edges if e.source == "proxy.admin.lazy" and e.target == "proxy.admin.ext"]
    assert lazy and not lazy[0].module_level, "a relative import inside a function is an edge too"


def test_product_code_never_imports_the_simulators_and_the_demo_is_loaded_lazily() -> None:
    edges = import_edges()
    into_sim = sorted({f"{e.source}:{e.line}" for e in edges
                       if e.target.startswith("proxy.sim") and not e.source.startswith("proxy.sim")
                       and e.source != "proxy.demo"})
    assert not into_sim, f"only proxy/demo.py may import proxy/sim: {into_sim}"
    demo = ("proxy.demo", "proxy.demo_check")  # the demo and its self-test, loaded only by `hyperswap demo`
    eager_demo = sorted({f"{e.source}:{e.line}" for e in edges
                         if e.target in demo and e.module_level and not e.source.startswith("proxy.sim")
                         and e.source not in demo})
    assert not eager_demo, f"import proxy.demo inside the function that runs the demo: {eager_demo}"
