"""The clock's promise: product code waits on the injected Clock, never on a real sleep of its own;
tests cross a threshold by advancing a ManualClock or by waiting on the event it produces, never
by sleeping for real."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.source_tree import python_files, source_file

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"
TESTS = ROOT / "tests"
# The real sleeps that may stay: the SystemClock itself, poll_until (state with no event to wait
# on), and the simulators (they stand in for engines, not the proxy).
ALLOWED = {("clock.py", "SystemClock.sleep"), ("tasks.py", "poll_until")}
# The real sleeps tests may keep: fakes that hang until cancelled or killed, so no threshold is
# crossed by their length; each with why. Keyed by file under tests/ and the enclosing function
# (or the module constant holding a child's script).
HANG_FOREVER = {
    ("integration/test_forwarding.py", "test_upstream_that_never_answers_gives_504.silent"):
        "an upstream that never answers: the proxy's read timeout cuts it",
    ("integration/test_http1.py", "test_read_timeout_applies_to_the_head.silent"):
        "an upstream that never answers: the pool's read timeout cuts it",
    ("unit/test_verify_stages.py", "test_a_stage_that_hangs_fails_after_its_timeout.slow"):
        "a stage that never ends: stage_timeout_s cuts it",
    ("integration/test_lifecycle_health.py", "test_health_names_failed_starts_orphans_and_an_unreachable_docker_socket"):
        "an orphaned child left by a crashed proxy, killed by the test",
    ("unit/test_departure.py", "serve_until_cancelled"):
        "a request being served until the departed client's link cancels it",
    ("unit/test_lifecycle_process.py", "STUBBORN"):
        "a child that ignores SIGTERM and waits to be killed",
    ("unit/test_lifecycle_process.py", "test_a_stop_reaches_what_the_child_spawned"):
        "a child and a grandchild that wait to be stopped",
    ("unit/test_no_real_sleeps.py", "test_the_check_sees_a_real_sleep"):
        "the check's own samples (text, never run)",
}
# A sleep written in a string: a child process's script.
SLEEP_IN_TEXT = re.compile(r"\b(?:asyncio|time)\.sleep\((?!\s*0\s*[,)])")


def real_sleeps(path: Path, *, in_strings: bool = False) -> list[tuple[str, int]]:
    """(enclosing function, line) of each asyncio.sleep/time.sleep call with an argument other than 0;
    `in_strings`: also of each such call written in a string (a child's script)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"{where}.{child.name}" if where else child.name
            elif (isinstance(child, ast.Assign) and not where and len(child.targets) == 1
                  and isinstance(child.targets[0], ast.Name)):
                inner = child.targets[0].id  # a module constant
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "sleep"
                    and isinstance(child.func.value, ast.Name) and child.func.value.id in ("asyncio", "time")
                    and not (child.args and isinstance(child.args[0], ast.Constant) and child.args[0].value == 0)):
                found.append((where, child.lineno))
            if (in_strings and isinstance(child, ast.Constant) and isinstance(child.value, str)
                    and SLEEP_IN_TEXT.search(child.value)):
                found.append((where, child.lineno))
            visit(child, inner)

    visit(source_file(path).tree, "")
    return found


def test_no_product_module_sleeps_for_real_outside_the_clock() -> None:
    offenders = [f"proxy/{path.relative_to(PROXY)}:{line} in {where}"
                 for path in (s.path for s in python_files(PROXY)) if "sim" not in path.relative_to(PROXY).parts
                 for where, line in real_sleeps(path)
                 if (str(path.relative_to(PROXY)), where) not in ALLOWED]
    assert not offenders, f"sleep on the injected Clock (proxy.clock), not for real: {offenders}"


def test_no_test_sleeps_for_real_but_the_hang_forever_fakes() -> None:
    found = {(str(path.relative_to(TESTS)), where, line)
             for path in (s.path for s in python_files(TESTS)) for where, line in real_sleeps(path, in_strings=True)}
    offenders = sorted(f"tests/{file}:{line} in {where or 'the module'}"
                       for file, where, line in found if (file, where) not in HANG_FOREVER)
    assert not offenders, (
        "a test sleeps for real: advance a ManualClock (proxy.clock), wait on the event the timeout "
        "produces, or poll_until under asyncio.timeout; a fake that hangs until cancelled goes in "
        f"HANG_FOREVER with its reason: {offenders}")
    stale = sorted(HANG_FOREVER.keys() - {(file, where) for file, where, _ in found})
    assert not stale, f"HANG_FOREVER names fakes that no longer sleep (remove them): {stale}"


def test_the_check_sees_a_real_sleep(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import asyncio, time\nasync def f():\n    await asyncio.sleep(0)\n    await asyncio.sleep(1)\n"
                      "def g(s=time.sleep):\n    time.sleep(0.5)\n"
                      "CHILD = '''\nimport time\ntime.sleep(0)\n'''\nSCRIPT = 'import time; time.sleep(600)'\n"
                      "def h():\n    return 'asyncio.sleep(0, result=1)', \"asyncio.sleep(0.05)\"\n")
    assert real_sleeps(module) == [("f", 4), ("g", 6)]
    assert real_sleeps(module, in_strings=True) == [("f", 4), ("g", 6), ("SCRIPT", 11), ("h", 13)]
