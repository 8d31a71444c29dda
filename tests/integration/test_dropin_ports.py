"""Clients change nothing: after `hyperswap install` (into a temp root) the proxy answers on the engines'
own ports (11434, 8188) in front of engines moved to 11435 and 8189, for the `ollama` library at its
default address and for ComfyUI's HTTP and websocket; `hyperswap uninstall` removes it all.
Fixed ports: run in a network namespace of its own (`unshare --net`), skipped where none can be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("scripts") / "dropin_clients.py"
ROOT = Path(__file__).resolve().parents[2]


def test_clients_at_the_engines_own_addresses_go_through_the_installed_proxy(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare or ip not installed (util-linux, iproute2)")
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    done = subprocess.run(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$1" "$2"',
                           sys.executable, str(SCRIPT), str(tmp_path / "root")],
                          capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's proxy, not an installed one
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-3000:] + done.stderr[-3000:]
