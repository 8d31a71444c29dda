"""The clock's promise: product code waits on the injected Clock, never on a real sleep of its own."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
# The real sleeps that may stay: the SystemClock itself, poll_until (state with no event to wait
# on), and the simulators (they stand in for engines, not the proxy).
ALLOWED = {("clock.py", "SystemClock.sleep"), ("tasks.py", "poll_until")}


def real_sleeps(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each asyncio.sleep/time.sleep call with an argument other than 0."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"{where}.{child.name}" if where else child.name
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "sleep"
                    and isinstance(child.func.value, ast.Name) and child.func.value.id in ("asyncio", "time")
                    and not (child.args and isinstance(child.args[0], ast.Constant) and child.args[0].value == 0)):
                found.append((where, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_product_module_sleeps_for_real_outside_the_clock() -> None:
    offenders = [f"proxy/{path.relative_to(PROXY)}:{line} in {where}"
                 for path in sorted(PROXY.rglob("*.py")) if "sim" not in path.relative_to(PROXY).parts
                 for where, line in real_sleeps(path)
                 if (str(path.relative_to(PROXY)), where) not in ALLOWED]
    assert not offenders, f"sleep on the injected Clock (proxy.clock), not for real: {offenders}"


def test_the_check_sees_a_real_sleep(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import asyncio, time\nasync def f():\n    await asyncio.sleep(0)\n    await asyncio.sleep(1)\n"
                      "def g(s=time.sleep):\n    time.sleep(0.5)\n")
    assert real_sleeps(module) == [("f", 4), ("g", 6)]
