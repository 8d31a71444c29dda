"""Supervision of the apps the proxy starts (design invariant 12, issue 33), with real children: a
crash after ready is noticed when it happens and the next request starts the app again; a proxy
killed -9 leaves nothing a restarted proxy would run a second copy beside; a port held by another
server fails the start naming it; a stop that leaves the port held is a failed stop, never `running`;
a `setsid` child is stopped with the app."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import httpx

from proxy.clock import SystemClock
from proxy.demo import Demo
from proxy.lifecycle import procs
from proxy.lifecycle.process import ProcessController
from proxy.lifecycle.ready import ReadyProbe, probe_once, probe_readiness
from proxy.lifecycle.state import TenantLifecycle
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, app_process, fast, free_port, port_open, process_tenant, proxy_of, stranger_on

WAIT_S = 10.0  # bounds a wait for a child; never reached when things work


def copies(pattern: str) -> list[int]:
    """The live processes whose command line holds `pattern` (a shell that runs one is not a copy)."""
    out = []
    for p in procs.processes():
        argv = procs.cmdline(p.pid) or ()
        if p.alive and argv and argv[0] != "sh" and pattern in " ".join(argv):
            out.append(p.pid)
    return out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def machine_of(demo: Demo, name: str = "app") -> TenantLifecycle:
    m = proxy_of(demo).broker.lifecycles.machine(name)
    assert m is not None
    return m


async def test_an_app_killed_after_ready_is_noticed_at_once_and_the_next_request_starts_it(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    machine = machine_of(demo)
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
    ctl = machine.controller
    assert isinstance(ctl, ProcessController) and ctl.pid is not None
    os.kill(ctl.pid, signal.SIGKILL)  # behind the proxy's back: an OOM kill, a CUDA fault
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: machine.state == "failed")
    assert "killed by signal 9 (SIGKILL)" in (machine.snapshot.error or "") and machine.snapshot.exit_code == -9
    (crash,) = [d for d in proxy_of(demo).decisions.recent() if d.kind == "exit"]
    assert crash.outcome["exit_code"] == -9 and crash.outcome["state"] == "failed", crash

    health = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    (entry,) = [e for e in health["entries"] if e["name"] == "lifecycle app"]
    assert entry["status"] == "failed" and "crashed while running" in entry["problem"], entry
    assert "restart: on-failure" in entry["fix"], entry

    again = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert again.status_code == 200 and machine.state == "running", again.text
    assert len(copies(f"http.server {port}")) == 1


async def test_restart_on_failure_starts_a_crashed_app_before_anyone_asks(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path, restart="on-failure")}))
    assert demo.proxy is not None
    machine = machine_of(demo)
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
    first = app_process(demo).pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: machine.state == "running" and app_process(demo).pid != first)
    assert port_open(port), "restarted by its policy, with no request"
    assert [d.kind for d in proxy_of(demo).decisions.recent() if d.kind in ("start", "exit")] == ["start", "exit", "start"]


# The proxy's start of a `process` tenant, in a process of its own that the test kills -9: the same
# controller and record as the proxy's. The app is a shell running the server in the background, so
# the server (a grandchild, in the app's session) outlives the shell the kernel kills with the proxy.
CRASHING_PROXY = textwrap.dedent("""
    import asyncio, json, sys
    from proxy.clock import SystemClock
    from proxy.config.settings import AdminSpec
    from proxy.lifecycle.build import default_state_dir
    from proxy.lifecycle.process import ProcessController
    from proxy.lifecycle.record import instance_dir

    async def main():
        state = instance_dir(default_state_dir(), AdminSpec().listen)  # the same instance as the demo's
        ctl = ProcessController("app", json.loads(sys.argv[1]), state_dir=state, clock=SystemClock())
        await ctl.start()
        print(ctl.pid, await ctl.guard.armed(), flush=True)
        await asyncio.Event().wait()  # until killed

    asyncio.run(main())
""")


async def crashing_proxy(port: int, tmp_path: Path, shell: str) -> tuple[dict[str, object], asyncio.subprocess.Process]:
    """The app tenant on `port`, its server run by `sh -c shell` ({server}: its command), started by a
    proxy that then dies with -9 (CRASHING_PROXY); the proxy's stdout says the shell's and guard's pids."""
    tenant = process_tenant(port, tmp_path)
    server = " ".join(tenant["release"]["command"])
    tenant["release"]["command"] = ["sh", "-c", shell.format(server=server)]
    crashed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_PROXY, __import__("json").dumps(tenant["release"]["command"]),
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
    return tenant, crashed


async def test_a_proxy_killed_9_and_started_again_runs_exactly_one_copy(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    tenant, crashed = await crashing_proxy(port, tmp_path, "{server} & wait")
    try:
        assert crashed.stdout is not None
        async with asyncio.timeout(WAIT_S):
            shell, guard = map(int, (await crashed.stdout.readline()).split())
            await poll_until(lambda: port_open(port))
        os.kill(guard, signal.SIGKILL)  # its guard dies first (as if killed with it): the record's part alone
        crashed.kill()  # the proxy dies: -9, no shutdown of any kind
        await crashed.wait()
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: not procs.same(shell, procs.start_time(shell) or -1))
        assert not procs.same(shell, procs.start_time(shell) or -1), "the app's own process dies with the proxy"
        left = copies(f"http.server {port}")
        assert len(left) == 1 and port_open(port), "the shell's server outlived it: what a restarted proxy finds"

        demo = await box(fast("default", tenants={"app": tenant}))
        assert demo.proxy is not None
        assert not copies(f"http.server {port}") and not port_open(port), \
            "the restarted proxy ended what the crashed run left (provably its own: session and start time)"
        answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
        assert answer.status_code == 200, answer.text
        assert len(copies(f"http.server {port}")) == 1, "exactly one copy of the app"
        await demo.stop()
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: not copies(f"http.server {port}"))
    finally:
        if crashed.returncode is None:
            crashed.kill()
            await crashed.wait()
        kill_all(copies(f"http.server {port}"))


async def test_a_port_held_by_another_server_fails_the_start_naming_it(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    stranger = await stranger_on(port, tmp_path)
    try:
        demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
        assert demo.proxy is not None
        answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert f"port {port} is already in use by pid {stranger.pid} (" in error and "http.server" in error, error
        assert f"kill {stranger.pid}" in answer.json()["fix"]
        assert machine_of(demo).state == "failed" and stranger.returncode is None, "the stranger is named, never killed"
    finally:
        stranger.kill()
        await stranger.wait()


# An app that serves its port and leaves a daemon behind (fork, setsid, fork) serving the same port
# (SO_REUSEPORT): no session and no parent link lead from the app to the daemon. With argv[3] "clean",
# the daemon also execs itself with an empty environment, so nothing (not the run's id, procs.RUN_VAR)
# leads to it: what no supervisor can tell from a stranger.
LEAVES_A_DAEMON = textwrap.dedent("""
    import http.server, os, socket, sys
    port = int(sys.argv[1])
    def serve():
        s = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler, bind_and_activate=False)
        s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.server_bind(); s.server_activate()
        return s
    if len(sys.argv) > 3 and sys.argv[3] == "daemon":  # the daemon, after its exec
        os.write(1, f"daemon {os.getpid()}\\n".encode())  # one write: print() may write in pieces, and
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
        serve().serve_forever()
    app = serve()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if len(sys.argv) > 3 and sys.argv[3] == "clean":
                os.execve(sys.executable, [sys.executable, "-c", SELF, *sys.argv[1:3], "daemon"], {})
            os.write(1, f"daemon {os.getpid()}\\n".encode())
            with open(sys.argv[2], "w") as f:
                f.write(str(os.getpid()))
            serve().serve_forever()
        os._exit(0)
    os.wait()
    os.write(1, b"serving\\n")  # two processes writing pieces of lines to one file interleave them
    app.serve_forever()
""")


def leaves_a_daemon(port: int, pidfile: Path, *extra: str) -> list[str]:
    """The command; the script knows its own text as SELF (for the daemon's exec)."""
    script = f"SELF = {LEAVES_A_DAEMON!r}\n" + LEAVES_A_DAEMON
    return [sys.executable, "-c", script, str(port), str(pidfile), *extra]


async def test_a_stop_that_leaves_the_port_held_fails_names_the_holder_and_is_never_running(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    tenant = process_tenant(port, tmp_path, release={"kind": "process", "stop_timeout_s": 2,
                                                     "command": leaves_a_daemon(port, tmp_path / "daemon.pid", "clean")})
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    machine = machine_of(demo)
    daemon = 0
    try:
        assert (await http.get(proxy_of(demo).url("app") + "/")).status_code == 200
        pidfile = tmp_path / "daemon.pid"  # written by the daemon itself, whatever its output does
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: pidfile.exists() and pidfile.read_text().strip())
        daemon = int(pidfile.read_text())
        try:
            async with asyncio.timeout(WAIT_S):
                await poll_until(lambda: any(line.startswith("daemon ") for line in machine.controller.output()))
        except TimeoutError:  # pragma: no cover - the lines came interleaved once (printed in pieces)
            raise AssertionError(f"the daemon ({daemon}) printed its line, but the app's output lacks it: "
                                 f"{machine.controller.output()} (state {machine.state})") from None
        stopped = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/stop")
        assert machine.state == "failed", f"a failed stop is never running: {machine.state} ({stopped.text})"
        assert f"port {port} is still held by pid {daemon}" in (machine.snapshot.error or ""), machine.snapshot.error
        (stop,) = [d for d in proxy_of(demo).decisions.recent() if d.kind == "stop"]
        assert stop.outcome["ok"] is False and stop.outcome["state"] == "failed", stop
    finally:  # the daemon outlives the stop by design: never leave it holding its port for later tests
        pidfile = tmp_path / "daemon.pid"
        if not daemon and pidfile.exists() and pidfile.read_text().strip():
            daemon = int(pidfile.read_text())
        kill_all([daemon] if daemon else [])


SETSID_CHILD = textwrap.dedent("""
    import http.server, os, subprocess, sys
    port = int(sys.argv[1])
    helper = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", f"helper-of-{port}"],
                              start_new_session=True)
    print("helper", helper.pid, flush=True)
    http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
""")


async def test_a_setsid_child_of_the_app_is_stopped_with_it(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    tenant = process_tenant(port, tmp_path, release={"kind": "process", "stop_timeout_s": 2,
                                                     "command": [sys.executable, "-c", SETSID_CHILD, str(port)]})
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    machine = machine_of(demo)
    helper = 0
    try:
        assert (await http.get(proxy_of(demo).url("app") + "/")).status_code == 200
        helper = int(next(line for line in machine.controller.output() if line.startswith("helper ")).split()[1])
        started = procs.start_time(helper)
        proc = procs.proc(helper)
        assert started is not None and proc is not None and proc.session == helper
        stopped = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/stop")
        assert stopped.status_code == 200 and machine.state == "stopped", stopped.text
        assert not procs.same(helper, started), "the child that left the app's session is stopped with it"
    finally:  # every helper any run of the app made (a start that failed under load and ran again made two)
        kill_all(copies(f"helper-of-{port}"))


async def test_an_app_stopped_with_sigstop_is_ended_once_declared_failed_and_a_fresh_copy_answers(
        http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Issue 42: a hung app was marked failed but left running, so the next request waited the whole
    start_timeout_s on its port. Now it is ended (SIGTERM with SIGCONT, SIGKILL after stop_timeout_s)
    as it is declared failed, and the next start is a fresh copy. The probe's misses are made quick
    (a short interval and a short try) only so the test does not wait 3 x 5 s."""
    port = free_port()
    tenant = process_tenant(port, tmp_path)
    ctl = ProcessController("app", tenant["release"]["command"], stop_timeout_s=2.0,
                            clock=SystemClock(), host="127.0.0.1", port=port)
    probe = ReadyProbe("127.0.0.1", port, f"http://127.0.0.1:{port}/hello.txt")
    machine = TenantLifecycle("app", ctl, probe_readiness(probe, SystemClock(), exited=ctl.exited, client=http,
                                                          owner=ctl.owns_port),
                              start_timeout_s=60.0, clock=SystemClock(), live=lambda: probe_once(probe, http, 0.2),
                              live_interval_s=0.05)
    try:
        await machine.ensure_running()
        hung = ctl.pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)  # alive, holding its port, answering nothing
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: machine.state == "failed")
        assert "stopped answering" in (machine.snapshot.error or ""), machine.snapshot.error
        machine.live = None  # the fresh copy is judged by its answer below, not by 0.2 s probes on a busy box
        async with asyncio.timeout(WAIT_S):
            await machine.ensure_running()  # waits for the hung copy's end, then starts a fresh one
        assert ctl.pid != hung and not procs.same(hung, procs.start_time(hung) or -1), "the hung copy is gone"
        answer = await http.get(f"http://127.0.0.1:{port}/hello.txt")
        assert answer.status_code == 200 and len(copies(f"http.server {port}")) == 1
    finally:
        await machine.aclose()
        kill_all(copies(f"http.server {port}"))


async def test_two_proxies_on_one_machine_with_the_same_tenant_names_never_touch_each_others_app(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Issue 42: a second demo or serve (other ports, same tenant name, one state folder) ended the
    first's running app at its start as "left behind by an earlier run", and its stop deleted the
    first's record. Each instance's records are its own (record.py)."""
    first_port, second_port = free_port(), free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = await box(fast("default", tenants={"app": process_tenant(first_port, tmp_path / "a")}))
    assert first.proxy is not None
    assert (await http.get(first.proxy.url("app") + "/hello.txt")).status_code == 200
    running = app_process(first).pid
    assert running is not None
    second = await box(fast("default", tenants={"app": process_tenant(second_port, tmp_path / "b")}))
    assert second.proxy is not None
    assert procs.same(running, procs.start_time(running) or -1) and machine_of(first).state == "running", \
        "the second proxy's start left the first's app alone"
    assert (await http.get(second.proxy.url("app") + "/hello.txt")).status_code == 200
    assert (await http.post(second.proxy.url("admin") + "/api/tenants/app/stop")).status_code == 200
    assert machine_of(first).state == "running" and port_open(first_port), "the other's stop touched nothing of it"
    assert not [d for d in first.proxy.decisions.recent() if d.kind == "exit"], "the first saw no exit"
    record = app_process(first).pidfile
    assert record is not None and record.exists(), "its record is still there for a restart to find"
    await second.stop()
    await first.stop()
    assert not copies(f"http.server {first_port}") and not copies(f"http.server {second_port}")


async def test_a_daemon_the_app_leaves_is_stopped_with_it_found_by_its_runs_id(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Issue 42 item 5: no session and no parent link lead to a daemon the app left (fork, setsid,
    fork); the run's id in its environment (procs.RUN_VAR) does, so the stop ends it too."""
    port = free_port()
    pidfile = tmp_path / "daemon.pid"
    tenant = process_tenant(port, tmp_path, release={"kind": "process", "stop_timeout_s": 2,
                                                     "command": leaves_a_daemon(port, pidfile)})
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    daemon = 0
    try:
        assert (await http.get(proxy_of(demo).url("app") + "/")).status_code == 200
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: pidfile.exists() and pidfile.read_text().strip())
        daemon = int(pidfile.read_text())
        started = procs.start_time(daemon) or -1
        stopped = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/stop")
        assert stopped.status_code == 200 and machine_of(demo).state == "stopped", stopped.text
        assert not procs.same(daemon, started) and not port_open(port), "the daemon it left is stopped with it"
    finally:
        kill_all([daemon] if daemon else [])


async def test_a_setsid_grandchild_left_by_a_proxy_killed_9_is_ended_by_the_restarted_one(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Issue 42 item 5: the shell's server called setsid and its parent died with the proxy: no session,
    no parent link, never seen by a stop. Its environment carries the run's id from the record."""
    port = free_port()
    tenant, crashed = await crashing_proxy(port, tmp_path, "setsid {server} & wait")
    try:
        assert crashed.stdout is not None
        async with asyncio.timeout(WAIT_S):
            guard = int((await crashed.stdout.readline()).split()[1])
            await poll_until(lambda: port_open(port))
        os.kill(guard, signal.SIGKILL)  # the record's part alone (the guard's: the test after this one)
        crashed.kill()  # the proxy dies: -9 (its command line names the server too: copies are counted after)
        await crashed.wait()
        (left,) = copies(f"http.server {port}")
        proc = procs.proc(left)
        assert proc is not None and proc.session == left, "the server left the app's session"
        demo = await box(fast("default", tenants={"app": tenant}))
        assert demo.proxy is not None
        assert not copies(f"http.server {port}") and not port_open(port), "ended by the restarted proxy"
        assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
        assert len(copies(f"http.server {port}")) == 1
    finally:
        if crashed.returncode is None:
            crashed.kill()
            await crashed.wait()
        kill_all(copies(f"http.server {port}"))


async def test_what_the_app_spawned_is_ended_by_its_guard_when_the_proxy_is_killed_9(tmp_path: Path) -> None:
    """Issue 42: an app behind a shell kept its port after kill -9 of the proxy until the proxy was
    started again. Its guard (lifecycle/guard.py) ends it when the proxy's end of its pipe closes:
    the shell's server, and a setsid one."""
    port, other = free_port(), free_port()
    tenant = process_tenant(port, tmp_path)
    server = " ".join(tenant["release"]["command"])
    command = ["sh", "-c", f"{server} & setsid {server.replace(str(port), str(other))} & wait"]
    crashed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_PROXY, __import__("json").dumps(command),
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
    try:
        assert crashed.stdout is not None
        async with asyncio.timeout(WAIT_S):
            guard = int((await crashed.stdout.readline()).split()[1])
            await poll_until(lambda: port_open(port) and port_open(other))
        crashed.kill()
        await crashed.wait()
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: not port_open(port) and not port_open(other))
        assert not copies(f"http.server {port}") and not copies(f"http.server {other}"), \
            "what the app spawned is gone without a restart of the proxy"
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: not procs.same(guard, procs.start_time(guard) or -1))
    finally:
        if crashed.returncode is None:
            crashed.kill()
            await crashed.wait()
        kill_all(copies(f"http.server {port}") + copies(f"http.server {other}"))
