"""The type check CI runs (`.venv/bin/mypy`, configured in pyproject.toml) is strict for the whole
package: no module of proxy/ is let off, so a strict error anywhere fails CI before the tests. The
tests are checked too (as Starlette's and httpx's are): a refactor that breaks one fails the check,
not the run."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _let_off(mypy: dict[str, Any], prefix: str) -> list[object]:
    """Overrides that exempt modules under `prefix` from the check or from strict."""
    return [o["module"] for o in mypy.get("overrides", [])
            if any(str(m).startswith(prefix) for m in ([o["module"]] if isinstance(o["module"], str) else o["module"]))
            and (o.get("ignore_errors") or o.get("strict") is False or o.get("check_untyped_defs") is False)]


def test_mypy_is_strict_for_every_module_of_the_package() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy.get("strict") is True, "pyproject.toml [tool.mypy] must say strict = true"
    assert "proxy" in mypy.get("packages", []), "mypy must check the proxy package"
    let_off = [o["module"] for o in mypy.get("overrides", [])
               if any(str(m).startswith("proxy") for m in ([o["module"]] if isinstance(o["module"], str) else o["module"]))
               and (o.get("ignore_errors") or o.get("strict") is False)]
    assert not let_off, f"modules of proxy/ exempted from the strict check: {let_off}"
    assert "mypy" in (ROOT / ".ci" / "run").read_text(), "CI runs mypy"


def test_the_tests_are_type_checked_with_nothing_let_off() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "tests" in mypy.get("packages", []), "mypy must check tests/ too (pyproject.toml [tool.mypy] packages)"
    assert not _let_off(mypy, "tests"), f"tests exempted from the strict check: {_let_off(mypy, 'tests')}"


def test_the_benches_are_type_checked_as_a_package_with_nothing_let_off() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "bench" in mypy.get("packages", []), "mypy must check bench/ too (pyproject.toml [tool.mypy] packages)"
    assert (ROOT / "bench" / "__init__.py").is_file(), "bench/ is a package: one import name per bench module"
    assert not _let_off(mypy, "bench"), f"benches exempted from the strict check: {_let_off(mypy, 'bench')}"
