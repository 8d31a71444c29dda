"""The shipped systemd units: what they say, and `systemd-analyze verify` on them where it exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.deploy.units import render_drop_in, render_unit, template

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")


def exe() -> list[str]:
    beside = Path(sys.executable).with_name("hyperswap")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "proxy.cli"]


def test_system_unit_orders_after_ollama_restarts_logs_to_the_journal_and_gates_on_check() -> None:
    unit = render_unit("system", ["/usr/local/bin/hyperswap"], "/etc/hyperswap/tenants.json")
    for line in ("After=network.target ollama.service", "Wants=ollama.service", "Restart=on-failure",
                 "StandardOutput=journal", "StandardError=journal",
                 "ExecStart=/usr/local/bin/hyperswap serve --config /etc/hyperswap/tenants.json",
                 "ExecStartPost=/usr/local/bin/hyperswap check --config /etc/hyperswap/tenants.json --ready-within 30",
                 "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in unit, f"system unit lacks {line!r}"
    assert "@" not in unit.replace("%h", ""), "a placeholder was left unfilled"


def test_an_exec_path_with_spaces_is_quoted() -> None:
    unit = render_unit("user", ["/home/me/my env/bin/hyperswap"], "%h/.config/hyperswap/tenants.json")
    assert 'ExecStart="/home/me/my env/bin/hyperswap" serve --config %h/.config/hyperswap/tenants.json' in unit


def test_templates_are_package_data() -> None:
    assert "[Service]" in template("system") and "[Service]" in template("user")


def _verify(tmp_path: Path, name: str, text: str, *extra_env: tuple[str, str]) -> str:
    path = tmp_path / name
    path.write_text(text)
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", **dict(extra_env)}
    done = subprocess.run([ANALYZE or "systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    return (done.stdout + done.stderr).strip() + ("" if done.returncode == 0 else f"\n(exit {done.returncode})")


@needs_analyze
@pytest.mark.parametrize("mode", ["system", "user"])
def test_systemd_analyze_verify_finds_nothing_wrong(tmp_path: Path, mode: str) -> None:
    config = "/etc/hyperswap/tenants.json" if mode == "system" else "%h/.config/hyperswap/tenants.json"
    report = _verify(tmp_path, "hyperswap.service", render_unit(mode, exe(), config))  # type: ignore[arg-type]
    assert report == "", f"systemd-analyze verify on the {mode} unit:\n{report}"


@needs_analyze
def test_systemd_analyze_verify_would_catch_a_bad_unit(tmp_path: Path) -> None:
    bad = render_unit("system", exe(), "/etc/hyperswap/tenants.json").replace("Restart=on-failure", "Restart=sometimes")
    assert "restart specifier" in _verify(tmp_path, "hyperswap.service", bad)


@needs_analyze
def test_the_ollama_drop_in_verifies_with_its_service(tmp_path: Path) -> None:
    (tmp_path / "ollama.service").write_text(f"[Service]\nExecStart={sys.executable} -c pass\n")
    (tmp_path / "ollama.service.d").mkdir()
    (tmp_path / "ollama.service.d" / "hyperswap.conf").write_text(render_drop_in({"OLLAMA_HOST": "127.0.0.1:11435"}))
    report = _verify(tmp_path, "ollama.service", (tmp_path / "ollama.service").read_text())
    assert report == "", report
