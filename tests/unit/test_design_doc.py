"""docs/design.md stays true to the tree: its module map names every module of proxy/ once, and the
invariants the code cites exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.source_tree import python_files

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def _module_map() -> dict[str, list[str]]:
    """folder -> the modules its row lists (`proxy/` rows merged: core and top)."""
    rows: dict[str, list[str]] = {}
    for line in DESIGN.read_text().splitlines():
        m = re.match(r"\| `(proxy/[a-z_/]*)`[^|]*\| ([^|]*) \|", line)
        if m and "README" not in m.group(2):
            rows.setdefault(m.group(1), []).extend(re.findall(r"`([a-z_0-9]+\.py)`", m.group(2)))
    return rows


def test_the_module_map_names_every_module_once() -> None:
    rows = _module_map()
    missing, extra, twice = [], [], []
    for folder, listed in rows.items():
        present = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        missing += [f"{folder}{n}" for n in sorted(present - set(listed))]
        extra += [f"{folder}{n}" for n in sorted(set(listed) - present)]
        twice += [f"{folder}{n}" for n in sorted({n for n in listed if listed.count(n) > 1})]
    folders = {f"proxy/{p.parent.relative_to(ROOT / 'proxy')}/".replace("proxy/./", "proxy/")
               for p in (ROOT / "proxy").rglob("*.py")
               if "sim" not in p.parts and "dashboard" not in p.parts}
    assert not missing, f"modules docs/design.md's module map does not name: {missing}"
    assert not extra, f"docs/design.md names modules that are gone: {extra}"
    assert not twice, f"docs/design.md names these twice: {twice}"
    assert folders <= set(rows), f"folders without a row in docs/design.md: {sorted(folders - set(rows))}"


def test_every_invariant_the_code_cites_is_in_the_design() -> None:
    numbered = {int(n) for n in re.findall(r"^(\d+)\. ", DESIGN.read_text(), re.M)}
    cited: set[int] = set()
    for source in python_files(ROOT / "proxy"):
        for group in re.findall(r"invariants? ((?:\d+(?:, | and )?)+)", source.text):
            cited |= {int(n) for n in re.findall(r"\d+", group)}
    assert cited, "the code cites no invariant: the pattern is broken"
    assert cited <= numbered, f"invariants cited in proxy/ but not in docs/design.md: {sorted(cited - numbered)}"
