"""Apps a daemon runs (issue 42): the `docker run` + `docker stop` shape that `stop_command` exists
for, with a stand-in daemon (no Docker here): its `run` stays in the foreground and passes SIGTERM
on, its `stop` asks the daemon, and the server is the daemon's child, never in the tree of what the
proxy started. Such a holder is the app's own when it came up after the start and something ties it
to the start (the stop command, a pid file); a stranger on the port before the start is still
refused, and a daemon's child nothing ties to the start is too."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from proxy.lifecycle import procs
from tests.integration.boxes import DemoFactory, app_process, fast, free_port, port_open, process_tenant, proxy_of, stranger_on

WAIT_S = 10.0

# The daemon: one Unix socket; `run PORT DIR` starts a file server (its own child) and answers while it
# runs, `stop PORT -` ends it. It writes the server's pid to DIR/server.pid, as a daemon's --pidfile.
DAEMON = textwrap.dedent("""
    import os, socket, subprocess, sys, threading
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sys.argv[1])
    srv.listen()
    print("ready", flush=True)
    servers = {}
    def handle(conn):
        f = conn.makefile("rw")
        cmd, port, folder = f.readline().split()
        if cmd == "run":
            p = subprocess.Popen([sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1", "--directory",
                                  folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            servers[port] = p
            with open(os.path.join(folder, "server.pid"), "w") as out:
                out.write(str(p.pid))
            f.write(f"running {p.pid}\\n"); f.flush()
            p.wait()
            f.write(f"exited {p.returncode}\\n"); f.flush()
        elif cmd == "stop" and port in servers:
            servers[port].terminate()
            servers[port].wait()
            f.write("stopped\\n"); f.flush()
        conn.close()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
""")

# The launcher (`docker run` / `docker stop` stand-in): `run` stays in the foreground until the server
# ends and passes SIGTERM on as a stop; `stop` asks the daemon and returns once it is done.
CLIENT = textwrap.dedent("""
    import signal, socket, sys
    path, cmd, port, folder = sys.argv[1:5]
    def ask(line):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(line.encode())
        return s
    s = ask(f"{cmd} {port} {folder}\\n")
    if cmd == "run":
        signal.signal(signal.SIGTERM, lambda *_: ask(f"stop {port} -\\n").recv(100))
    for line in s.makefile():
        print(line.strip(), flush=True)
""")


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Path]:
    """The stand-in daemon, started before any proxy (as dockerd is), in a session of its own; ended
    with every server it runs at the test's end."""
    sock = tmp_path / "d.sock"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", DAEMON, str(sock), start_new_session=True,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(WAIT_S):
            assert (await proc.stdout.readline()).strip() == b"ready"
        yield sock
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def daemon_tenant(port: int, folder: Path, sock: Path, **release: object) -> dict[str, object]:
    tenant = process_tenant(port, folder)
    run = [sys.executable, "-c", CLIENT, str(sock), "run", str(port), str(folder)]
    tenant["release"] = {"kind": "process", "stop_timeout_s": 5, "command": run, **release}
    return tenant


def stop_command(port: int, sock: Path) -> list[str]:
    return [sys.executable, "-c", CLIENT, str(sock), "stop", str(port), "-"]


async def test_a_daemon_run_app_with_a_stop_command_starts_answers_and_stops(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, daemon: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": daemon_tenant(port, tmp_path, daemon,
                                                                    stop_command=stop_command(port, daemon))}))
    assert demo.proxy is not None
    answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert answer.status_code == 200, answer.text
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None and machine.state == "running"
    server = int((tmp_path / "server.pid").read_text())
    ctl = app_process(demo)
    assert ctl.pid is not None and ctl.pid != server and server not in procs.tree(ctl.pid, ctl.pid), \
        "the holder is the daemon's child"
    holders = ctl.describe()["holders"]
    assert isinstance(holders, dict) and str(server) in holders, ctl.describe()
    stopped = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/stop")
    assert stopped.status_code == 200 and machine.state == "stopped", stopped.text
    assert not port_open(port) and not procs.same(server, procs.start_time(server) or -1)
    assert ctl.describe()["stop_error"] is None, "stopped by its stop command, not by signals"
    again = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert again.status_code == 200, "and it starts again"


async def test_a_daemon_run_app_named_by_its_pid_file_is_the_apps_own(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, daemon: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": daemon_tenant(port, tmp_path, daemon,
                                                                    pid_file=str(tmp_path / "server.pid"))}))
    assert demo.proxy is not None
    answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert answer.status_code == 200, answer.text
    stopped = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/stop")
    assert stopped.status_code == 200, stopped.text
    assert not port_open(port)


async def test_a_daemons_child_nothing_ties_to_the_start_is_refused(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, daemon: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": daemon_tenant(port, tmp_path, daemon)}))
    assert demo.proxy is not None
    answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert answer.status_code == 503, answer.text
    assert f"port {port} answers, but it is held by pid" in answer.json()["error"], answer.text


async def test_a_stranger_on_the_port_before_the_start_is_still_refused_with_a_stop_command(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, daemon: Path) -> None:
    port = free_port()
    stranger = await stranger_on(port, tmp_path)
    try:
        demo = await box(fast("default", tenants={"app": daemon_tenant(port, tmp_path, daemon,
                                                                        stop_command=stop_command(port, daemon))}))
        assert demo.proxy is not None
        answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
        assert answer.status_code == 503, answer.text
        assert f"already in use by pid {stranger.pid}" in answer.json()["error"], answer.text
        assert stranger.returncode is None, "named, never killed"
    finally:
        stranger.kill()
        await stranger.wait()
