""".ci/run checks the Python version before anything else (issue 41): on 3.10, pip's own message
("No matching distribution found for uvicorn") names neither the version needed nor the fix."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_refuses_an_old_python_first_with_the_version_and_the_fix(tmp_path: Path) -> None:
    old = tmp_path / "python3.10"
    old.write_text('#!/bin/sh\ncase "$2" in *exit*) exit 1;; *) echo 3.10;; esac\n')
    old.chmod(0o755)
    run = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env={**os.environ, "PYTHON": str(old)},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 1, run
    assert "needs Python 3.11 or newer" in run.stderr and "is 3.10" in run.stderr, run.stderr
    assert "PYTHON=python3.11 bash .ci/run" in run.stderr, run.stderr
    assert run.stdout == "", "it did something before the check"
