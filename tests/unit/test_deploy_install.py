"""`hyperswap install` / `uninstall`: the plan, the port check, and an exact undo, all under a temp root.

No test touches /etc or runs systemctl: files go under tmp_path (--root) and commands to a recorder."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.deploy import install as inst
from proxy.deploy.ports import PortHolder, holders_here
from proxy.errors import HyperSwapError


class Recorder:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail = fail

    def run(self, argv: Sequence[str]) -> tuple[int, str]:
        self.calls.append(tuple(argv))
        return (1, "boom") if self.fail and self.fail in argv else (0, "")


def no_holders(port: int) -> list[PortHolder]:
    return []


def args(action: str, root: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args([action, "--root", str(root), *extra])


def run(action: str, root: Path, *extra: str, runner: Recorder | None = None,
        holders: Callable[[int], list[PortHolder]] = no_holders) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = inst.main(args(action, root, *extra), action, runner=runner or Recorder(), holders=holders, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_install_puts_the_proxy_on_the_engines_ports_and_moves_ollama_by_drop_in(tmp_path: Path) -> None:
    runner = Recorder()
    rc, out, _ = run("install", tmp_path, runner=runner)
    assert rc == 0, out
    config = json.loads((tmp_path / "etc/hyperswap/tenants.json").read_text())
    assert config["tenants"]["ollama"] == {"listen": "127.0.0.1:11434", "upstream": "http://127.0.0.1:11435"}
    assert config["tenants"]["comfyui"] == {"listen": "127.0.0.1:8188", "upstream": "http://127.0.0.1:8189"}
    drop_in = (tmp_path / "etc/systemd/system/ollama.service.d/hyperswap.conf").read_text()
    assert "[Service]\nEnvironment=OLLAMA_HOST=127.0.0.1:11435\n" in drop_in
    unit = (tmp_path / "etc/systemd/system/hyperswap.service").read_text()
    assert "serve --config /etc/hyperswap/tenants.json" in unit and "Restart=on-failure" in unit
    assert runner.calls == [("systemctl", "daemon-reload"), ("systemctl", "try-restart", "ollama.service"),
                            ("systemctl", "enable", "--now", "hyperswap.service")]
    assert "python main.py --port 8189" in out, "the ComfyUI flag must be shown"


def test_dry_run_prints_every_file_and_command_and_writes_nothing(tmp_path: Path) -> None:
    runner = Recorder()
    rc, out, _ = run("install", tmp_path, "--dry-run", runner=runner)
    assert rc == 0
    assert snapshot(tmp_path) == {} and runner.calls == []
    for text in ("/etc/systemd/system/hyperswap.service", "Environment=OLLAMA_HOST=127.0.0.1:11435",
                 '"listen": "127.0.0.1:11434"', "systemctl daemon-reload", "systemctl enable --now hyperswap.service",
                 "/var/lib/hyperswap/install.json", "--port 8189"):
        assert text in out, f"dry run does not show {text!r}"


def test_uninstall_restores_exactly_what_was_there(tmp_path: Path) -> None:
    mine = {"tenants": {"comfyui": {"priority": 70}}, "proxy": {"queue_timeout_s": 60}}
    cfg = tmp_path / "etc/hyperswap/tenants.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps(mine))
    other = tmp_path / "etc/systemd/system/ollama.service.d/gpu.conf"  # the user's own drop-in: never touched
    other.parent.mkdir(parents=True)
    other.write_text("[Service]\nEnvironment=OLLAMA_KEEP_ALIVE=1h\n")
    before = snapshot(tmp_path)
    assert run("install", tmp_path)[0] == 0
    installed = json.loads(cfg.read_text())
    assert installed["tenants"]["comfyui"]["priority"] == 70 and installed["proxy"] == {"queue_timeout_s": 60}
    runner = Recorder()
    rc, out, err = run("uninstall", tmp_path, runner=runner)
    assert rc == 0, err
    assert snapshot(tmp_path) == before
    assert runner.calls[0] == ("systemctl", "disable", "--now", "hyperswap.service"), "the proxy leaves the ports first"
    assert ("systemctl", "try-restart", "ollama.service") in runner.calls
    assert "python main.py --port 8189" in out  # ComfyUI goes back by hand too


def test_uninstall_removes_every_file_and_folder_install_created(tmp_path: Path) -> None:
    (tmp_path / "etc/systemd/system").mkdir(parents=True)  # there before: stays
    assert run("install", tmp_path)[0] == 0
    assert (tmp_path / "etc/systemd/system/ollama.service.d").is_dir()
    assert run("uninstall", tmp_path)[0] == 0
    assert snapshot(tmp_path) == {}
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["etc", "etc/systemd", "etc/systemd/system"]


def test_a_folder_install_created_that_holds_something_else_now_stays(tmp_path: Path) -> None:
    assert run("install", tmp_path)[0] == 0
    theirs = tmp_path / "etc/hyperswap/notes.txt"
    theirs.write_text("mine")
    assert run("uninstall", tmp_path)[0] == 0
    assert snapshot(tmp_path) == {"etc/hyperswap/notes.txt": "mine"}


def test_uninstall_refuses_a_file_changed_since_install_unless_forced(tmp_path: Path) -> None:
    assert run("install", tmp_path)[0] == 0
    cfg = tmp_path / "etc/hyperswap/tenants.json"
    cfg.write_text(cfg.read_text().replace("11435", "11499"))
    with pytest.raises(HyperSwapError, match=r"changed since install: /etc/hyperswap/tenants\.json"):
        run("uninstall", tmp_path)
    assert cfg.exists()
    assert run("uninstall", tmp_path, "--force")[0] == 0
    assert not cfg.exists()


def test_install_twice_is_refused(tmp_path: Path) -> None:
    assert run("install", tmp_path)[0] == 0
    with pytest.raises(HyperSwapError, match="already installed"):
        run("install", tmp_path)


def test_a_port_held_by_another_program_is_refused_naming_it(tmp_path: Path) -> None:
    def holders(port: int) -> list[PortHolder]:
        return [PortHolder(port, "127.0.0.1", 4242, "nginx", "nginx: master process")] if port == 11435 else []

    with pytest.raises(HyperSwapError) as exc:
        run("install", tmp_path, holders=holders)
    assert "port 11435 (for ollama's engine)" in exc.value.message and "pid 4242 (nginx" in exc.value.message
    assert snapshot(tmp_path) == {}, "nothing is written when a port is taken"


def test_the_engine_holding_its_own_port_is_not_in_the_way(tmp_path: Path) -> None:
    def holders(port: int) -> list[PortHolder]:
        return {11434: [PortHolder(port, "127.0.0.1", 900, "ollama", "/usr/local/bin/ollama serve")],
                8188: [PortHolder(port, "127.0.0.1", 901, "python3", "python3 /opt/ComfyUI/main.py")]}.get(port, [])

    assert run("install", tmp_path, holders=holders)[0] == 0


def test_another_program_on_the_engines_port_is_refused(tmp_path: Path) -> None:
    def holders(port: int) -> list[PortHolder]:
        return [PortHolder(port, "0.0.0.0", 77, "python3", "python3 -m http.server 8188")] if port == 8188 else []

    with pytest.raises(HyperSwapError, match=r"port 8188 \(for comfyui's proxy\).*pid 77") as exc:
        run("install", tmp_path, holders=holders)
    # a ComfyUI started as plain `python main.py` is not named by the shipped patterns: the message says what to do then
    assert "stop it, install, then start it with `python main.py --port 8189`" in exc.value.message


def test_port_and_skip_options(tmp_path: Path) -> None:
    assert run("install", tmp_path, "--port", "ollama=11500", "--skip", "comfyui")[0] == 0
    config = json.loads((tmp_path / "etc/hyperswap/tenants.json").read_text())
    assert config["tenants"] == {"ollama": {"listen": "127.0.0.1:11434", "upstream": "http://127.0.0.1:11500"}}
    with pytest.raises(HyperSwapError, match="TENANT=PORT"):
        run("install", tmp_path / "x", "--port", "ollama")


def test_user_install_writes_no_system_file_and_says_what_root_must_do(tmp_path: Path) -> None:
    runner = Recorder()
    rc, out, _ = run("install", tmp_path, "--user", runner=runner)
    assert rc == 0
    home = Path.home()  # the autouse fixture's temp HOME
    files = snapshot(tmp_path)
    assert not any(p.startswith("etc/") for p in files), files
    unit = files[str((home / ".config/systemd/user/hyperswap.service").relative_to("/"))]
    assert "--config %h/.config/hyperswap/tenants.json" in unit and "WantedBy=default.target" in unit
    assert "/etc/systemd/system/ollama.service.d/hyperswap.conf" in out and "OLLAMA_HOST=127.0.0.1:11435" in out
    assert all(c[:2] == ("systemctl", "--user") for c in runner.calls)
    assert run("uninstall", tmp_path, "--user")[0] == 0 and snapshot(tmp_path) == {}


def test_a_failed_command_stops_and_leaves_an_undoable_install(tmp_path: Path) -> None:
    rc, _, err = run("install", tmp_path, runner=Recorder(fail="try-restart"))
    assert rc == 1 and "try-restart ollama.service` failed" in err
    assert (tmp_path / "var/lib/hyperswap/install.json").exists()
    assert run("uninstall", tmp_path)[0] == 0 and snapshot(tmp_path) == {}


def test_a_system_install_without_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HyperSwapError, match="needs root"):
        inst.main(build_parser().parse_args(["install"]), "install", runner=Recorder(), holders=no_holders)


def test_holders_here_names_this_process_for_a_socket_it_listens_on() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = holders_here(port)
    assert [h.pid for h in found] == [os.getpid()], found
    assert "pid" in found[0].describe() and str(port) in found[0].describe()
