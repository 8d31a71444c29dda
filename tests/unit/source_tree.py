"""One parse of the tree for every structure test (complexity, module size, layers and imports, one
owner, no real sleeps, engine ports and seam, release-kind switches, the design doc's map).

Each of those checks used to read and `ast.parse` every file of proxy/ itself: nine walks of ~140
files, about 0.6 s of CPU each. Here a file is read, parsed and walked once per test process (an xdist
worker is one) and every check reads the same `SourceFile`. The files do not change during a run;
a check's own samples (text, or files it writes under tmp_path) are parsed as they come, through
`source_file` (a new path) or `nodes_of` / `tree_of` (a string).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"
TESTS = ROOT / "tests"


class SourceFile:
    """A Python file as the checks read it: its text, its syntax tree, every node of the tree (in
    `ast.walk` order), and its path relative to the repository."""

    __slots__ = ("_nodes", "path", "text", "tree")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()
        self.tree = ast.parse(self.text, str(path))
        self._nodes: tuple[ast.AST, ...] | None = None

    @property
    def nodes(self) -> tuple[ast.AST, ...]:
        if self._nodes is None:
            self._nodes = tuple(ast.walk(self.tree))
        return self._nodes

    def rel(self, base: Path = ROOT) -> str:
        return self.path.relative_to(base).as_posix()


@functools.cache
def source_file(path: Path) -> SourceFile:
    """The file at `path`, read and parsed once per process."""
    return SourceFile(path)


@functools.cache
def python_files(folder: Path) -> tuple[SourceFile, ...]:
    """Every `*.py` under `folder`, sorted by path, each parsed once (shared with `source_file`)."""
    return tuple(source_file(p) for p in sorted(folder.rglob("*.py")))


def tree_of(source: str | SourceFile, where: str = "<sample>") -> ast.Module:
    """The syntax tree of a shared file, or of a check's own sample text."""
    return source.tree if isinstance(source, SourceFile) else ast.parse(source, where)


def nodes_of(source: str | SourceFile, where: str = "<sample>") -> Sequence[ast.AST]:
    """Every node (`ast.walk` order) of a shared file, walked once, or of a sample text."""
    return source.nodes if isinstance(source, SourceFile) else tuple(ast.walk(ast.parse(source, where)))


def text_of(source: str | SourceFile) -> str:
    return source.text if isinstance(source, SourceFile) else source
