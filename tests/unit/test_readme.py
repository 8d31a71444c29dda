"""The README stays the short front door: its links resolve, and its two quick-start commands are
the ones that work (the first runs the demo, the second is CI, and what it says CI runs is in .ci/run)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (its toc slugs: lower case, punctuation dropped, spaces to -)."""
    out = set()
    for heading in re.findall(r"(?m)^#{1,6} (.+)$", page.read_text()):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        out.add(re.sub(r"[\s]+", "-", text))
    return out


def test_every_link_in_the_readme_resolves() -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL: not checked offline
        path, _, anchor = target.partition("#")
        dest = ROOT / path if path else README
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(dest):
            broken.append(f"{target}: {path or 'README.md'} has no heading #{anchor}")
    assert not broken, f"README links that do not resolve: {broken}"


def test_the_quick_start_commands_are_the_demo_and_ci() -> None:
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2, "the README's quick start has two sh blocks"
    first, second = blocks[0].strip(), blocks[1].strip()
    assert first.endswith(".venv/bin/hyperswap demo"), f"the first command should run the demo: {first}"
    assert second == "bash .ci/run", f"the second command should be CI's: {second}"


def test_what_the_readme_says_ci_runs_is_what_ci_runs() -> None:
    readme, ci = README.read_text(), CI.read_text()
    for command in re.findall(r"`(\.venv/bin/[^`]+)`", readme):
        for part in command.split(" && "):
            assert part in ci, f"the README says CI runs `{part}`, but .ci/run does not"
    assert "mkdocs build --strict" in readme and "mkdocs build --strict" in ci
    assert "'.[test,docs]'" in ci and "`test` and `docs` extras" in readme


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= 160, f"README.md has {lines} lines: the manual is the site under docs/; link to a page instead"


def test_ci_waits_for_the_dpkg_lock_instead_of_failing() -> None:
    ci = CI.read_text()
    for line in [x for x in ci.splitlines() if "apt-get" in x and not x.lstrip().startswith("#")]:
        assert "apt-get \"${lock[@]}\"" in line or "DPkg::Lock::Timeout" in line, f"an apt-get that fails on a held lock: {line}"
    assert "lock=(-o DPkg::Lock::Timeout=600)" in ci
