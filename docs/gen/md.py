"""Markdown pieces shared by the generators."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(text: str) -> str:
    """One table cell: no line breaks, no bare pipes."""
    return " ".join(text.split()).replace("|", "\\|")


def code(text: str) -> str:
    """Inline code that survives a table (a pipe inside is escaped for the table)."""
    return f"`{text}`"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
