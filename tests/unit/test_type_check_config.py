"""The type check CI runs (`.venv/bin/mypy`, configured in pyproject.toml) is strict for the whole
package: no module of proxy/ is let off, so a strict error anywhere fails CI before the tests."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_strict_for_every_module_of_the_package() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy.get("strict") is True, "pyproject.toml [tool.mypy] must say strict = true"
    assert "proxy" in mypy.get("packages", []), "mypy must check the proxy package"
    let_off = [o["module"] for o in mypy.get("overrides", [])
               if any(str(m).startswith("proxy") for m in ([o["module"]] if isinstance(o["module"], str) else o["module"]))
               and (o.get("ignore_errors") or o.get("strict") is False)]
    assert not let_off, f"modules of proxy/ exempted from the strict check: {let_off}"
    assert "mypy" in (ROOT / ".ci" / "run").read_text(), "CI runs mypy"
