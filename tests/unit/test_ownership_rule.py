"""The ownership rule (proxy/lifecycle/ownership.py) on real processes, the cgroups read faked: a port
holder outside the tree is the app's own only when it came up after a start that found the port free
and something ties it to that start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.lifecycle import ownership, procs
from proxy.lifecycle.ownership import Start, tie


@pytest.fixture
def holder() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_started_before_the_start_or_on_a_port_that_was_not_free_is_never_the_apps(holder: int) -> None:
    started = procs.start_time(holder)
    assert started is not None
    assert tie(holder, Start(started + 1, True, stop_command=True), {}) is None, "present before the start"
    assert tie(holder, Start(started, False, stop_command=True), {}) is None, "the port was held at the start"
    assert tie(holder, Start(started, True), {}) is None, "nothing ties it to the start"
    assert tie(holder, Start(started, True, stop_command=True), {}) is not None


def test_a_pid_file_ties_the_holder_or_its_parent(holder: int, tmp_path: Path) -> None:
    started = procs.start_time(holder) or 0
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(f"{os.getpid()}\n")  # the holder's parent: a daemon that names itself
    assert tie(holder, Start(started, True, pid_file=pid_file), {}) == f"named by its pid file {pid_file}"
    pid_file.write_text("1")
    assert tie(holder, Start(started, True, pid_file=pid_file), {}) is None


def test_a_cgroup_the_start_made_ties_the_holder_but_the_proxys_own_does_not(
        holder: int, monkeypatch: pytest.MonkeyPatch) -> None:
    started = procs.start_time(holder) or 0
    groups = {holder: "/system.slice/run-u42.scope", 4242: "/system.slice/run-u42.scope"}
    monkeypatch.setattr(ownership, "cgroup", lambda pid: groups.get(pid, "/user.slice/session-1.scope"))
    tree = {4242: 1}
    assert "cgroup the start made" in (tie(holder, Start(started, True), tree) or "")
    groups[holder] = groups[4242] = "/user.slice/session-1.scope"  # the proxy's own: shared with everything
    assert tie(holder, Start(started, True), tree) is None

