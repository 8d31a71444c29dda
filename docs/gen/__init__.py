"""The reference pages generated from the code: `python -m docs.gen` writes them, `--check` says which are stale.

Each page under docs/ keeps its hand-written text around one generated block between two marker lines;
only the block is rewritten. tests/unit/test_docs_generated.py regenerates every block in memory and
fails, naming this command, when a committed page differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
COMMAND = "python -m docs.gen"


@dataclass(frozen=True, slots=True)
class Generated:
    """One generated block: its page, what it is made from, and the function that writes it."""

    name: str
    page: Path
    source: str
    render: Callable[[], str]

    def begin(self) -> str:
        return f"<!-- BEGIN GENERATED {self.name}: `{COMMAND}` writes this block from {self.source}; edit that, not this -->"

    def end(self) -> str:
        return f"<!-- END GENERATED {self.name} -->"

    def expected(self, text: str) -> str:
        """`text` (the page as it is) with its block as the code makes it now."""
        pattern = re.compile(re.escape(self.begin().split(":", 1)[0]) + r".*?" + re.escape(self.end()), re.S)
        if not pattern.search(text):
            raise ValueError(f"{self.page.relative_to(DOCS.parent)} has no block for {self.name}: put the two marker "
                             f"lines where it goes:\n{self.begin()}\n{self.end()}")
        block = f"{self.begin()}\n\n{self.render().strip()}\n\n{self.end()}"
        return pattern.sub(lambda _: block, text, count=1)


def blocks() -> list[Generated]:
    from docs.gen import api, cli, config, metrics

    return [
        Generated("cli", DOCS / "reference" / "cli.md", "proxy/cli.py's argparse parser", cli.render),
        Generated("tenants-json", DOCS / "reference" / "tenants-json.md", "proxy/config/'s pydantic models",
                  config.render),
        Generated("admin-api", DOCS / "reference" / "admin-api.md", "proxy/admin/openapi.py's OpenAPI document",
                  api.render),
        Generated("metrics", DOCS / "reference" / "metrics.md", "proxy/admin/metrics.py's Prometheus registry",
                  metrics.render),
    ]


def stale() -> list[Generated]:
    """The blocks whose committed page differs from what the code makes now."""
    return [g for g in blocks() if g.expected(g.page.read_text()) != g.page.read_text()]


def write() -> list[Generated]:
    """Rewrite every stale block; returns the ones rewritten."""
    changed = stale()
    for g in changed:
        g.page.write_text(g.expected(g.page.read_text()))
    return changed
