"""What llama-swap users rely on, with real children behind the whole proxy (issue 33 item 8): a stop
command instead of signals (and the signals when it fails), preload at the proxy's start (never
holding it up; a failure shown in health), the app's output as server-sent events, and stop-all
(idle ones stopped, busy ones named)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.demo import Demo
from proxy.lifecycle.state import TenantLifecycle
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, app_process, fast, free_port, port_open, process_tenant, proxy_of

PY = sys.executable
WAIT_S = 10.0  # bounds a wait; never reached when things work
# A file server on argv[1] serving argv[3] that writes its pid to argv[2] first (for a stop command to
# signal it), and, given argv[4], waits for a word on that FIFO before it binds (a slow start).
APP = ("import functools, http.server, os, sys\n"
       "open(sys.argv[2], 'w').write(str(os.getpid()))\n"
       "if len(sys.argv) > 4: os.read(os.open(sys.argv[4], os.O_RDONLY), 1)\n"
       "h = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[3])\n"
       "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), h).serve_forever()\n")
# Sends SIGUSR1 to the pid in argv[1]: an app ended by it shows exit code -10, which no stop by signals gives.
USR1 = "import os, signal, sys; os.kill(int(open(sys.argv[1]).read()), signal.SIGUSR1)"


def app_tenant(folder: Path, name: str, *, slow: Path | None = None, **release: object) -> dict[str, Any]:
    port = free_port()
    pidfile = folder / f"{name}.pid"
    tenant = process_tenant(port, folder)
    tenant["release"] = {"kind": "process", "stop_timeout_s": 2,
                         "command": [PY, "-c", APP, str(port), str(pidfile), str(folder),
                                     *([str(slow)] if slow else [])], **release}
    return tenant


async def open_gate(gate: Path, why: Callable[[], str]) -> None:
    """Write the word the slow app waits for on its FIFO, once the app has it open for reading. A
    blocking open would wait in a thread for ever if the app died first (a test that hung CI once):
    a non-blocking open fails (ENXIO) until the reader is there, and the wait is bounded."""
    opened: list[int] = []

    def opened_for_writing() -> bool:
        try:
            opened.append(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        return bool(opened)

    try:
        async with asyncio.timeout(WAIT_S):
            await poll_until(opened_for_writing)
    except TimeoutError:
        raise AssertionError(f"the slow app never opened its FIFO: {why()}") from None
    try:
        os.write(opened[0], b"go")
    finally:
        os.close(opened[0])


def machine_of(demo: Demo, name: str) -> TenantLifecycle:
    assert demo.proxy is not None
    m = proxy_of(demo).broker.lifecycles.machine(name)
    assert m is not None
    return m


def upstream_port(demo: Demo, name: str) -> int:
    assert demo.proxy is not None
    upstream = proxy_of(demo).registry.get(name).upstream
    assert upstream is not None
    return int(upstream.rsplit(":", 1)[1])


async def health_entries(http: httpx.AsyncClient, admin: str) -> dict[str, list[dict[str, Any]]]:
    entries: dict[str, list[dict[str, Any]]] = {}
    for e in (await http.get(admin + "/api/health")).json()["entries"]:
        entries.setdefault(e["name"], []).append(e)
    return entries


# -- the stop command ------------------------------------------------------------------------------

async def test_an_admin_stop_runs_the_stop_command_and_a_failing_one_falls_back_to_signals(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    good = app_tenant(tmp_path, "good", stop_command=[PY, "-c", USR1, str(tmp_path / "good.pid")])
    bad = app_tenant(tmp_path, "bad", stop_command=[PY, "-c", "import sys; print('no such container', "
                                                              "file=sys.stderr); sys.exit(4)"])
    demo = await box(fast("default", tenants={"good": good, "bad": bad}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    for name in ("good", "bad"):
        assert (await http.post(f"{admin}/api/tenants/{name}/start")).status_code == 200

    stopped = await http.post(admin + "/api/tenants/good/stop")
    assert stopped.status_code == 200, stopped.text
    controller = stopped.json()["lifecycle"]["controller"]
    assert controller["exit_code"] == -signal.SIGUSR1, f"the stop command ended it, not SIGTERM: {controller}"
    assert controller["stop_error"] is None and not port_open(upstream_port(demo, "good"))

    fell_back = await http.post(admin + "/api/tenants/bad/stop")
    assert fell_back.status_code == 200, f"the signals stopped it once the command failed: {fell_back.text}"
    controller = fell_back.json()["lifecycle"]["controller"]
    assert controller["exit_code"] == -signal.SIGTERM, controller
    assert "exited with code 4" in controller["stop_error"] and "no such container" in controller["stop_error"]
    assert not port_open(upstream_port(demo, "bad"))
    (entry,) = (await health_entries(http, admin))["lifecycle bad"]
    assert entry["status"] == "failed" and "stopped it with signals" in entry["problem"] and entry["fix"], entry


# -- preload -----------------------------------------------------------------------------------------

async def test_preload_starts_apps_once_the_proxy_is_up_and_health_shows_a_failed_one(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    gate = tmp_path / "slow.fifo"
    os.mkfifo(gate)
    slow = {**app_tenant(tmp_path, "slow", slow=gate), "preload": True}
    broken = {**process_tenant(free_port(), tmp_path), "preload": True, "start_timeout_s": 5,
              "release": {"kind": "process", "command": [PY, "-c", "import sys; print('fatal: no model file', "
                                                                   "file=sys.stderr); sys.exit(3)"]}}
    lazy = app_tenant(tmp_path, "lazy")
    demo = await box(fast("default", tenants={"slow": slow, "broken": broken, "lazy": lazy}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    # The proxy is up and answers while the slow app still waits to bind: a preload never holds it up.
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: machine_of(demo, "slow").state == "starting")
    assert (await http.get(admin + "/api/tenants")).status_code == 200
    await open_gate(gate, lambda: f"slow is {machine_of(demo, 'slow').state}: {machine_of(demo, 'slow').snapshot.error}")
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: machine_of(demo, "slow").state == "running")
        await poll_until(lambda: machine_of(demo, "broken").preload_error is not None)
    assert port_open(upstream_port(demo, "slow")), "started without any request"
    assert machine_of(demo, "lazy").state == "stopped", "a tenant without preload waits for its first request"
    slow_view = (await http.get(admin + "/api/tenants/slow")).json()["lifecycle"]
    assert slow_view["preload"] is True and slow_view["preload_error"] is None, slow_view
    starts = [(d.tenant, d.outcome.get("result")) for d in proxy_of(demo).decisions.recent(200) if d.kind == "start"]
    assert ("slow", "ok") in starts and ("broken", "failed") in starts, starts

    entries = await health_entries(http, admin)
    preload = [e for e in entries["lifecycle broken"] if "preload" in e["problem"]]
    assert preload and preload[0]["status"] == "failed", entries["lifecycle broken"]
    assert "exited with code 3" in preload[0]["problem"] or "fatal: no model file" in preload[0]["problem"], preload
    assert all(e["status"] == "ok" for e in entries["lifecycle slow"]), entries["lifecycle slow"]


# -- logs ----------------------------------------------------------------------------------------------

async def sse_events(response: httpx.Response) -> Any:
    """(event, data) of each frame of a text/event-stream answer, as they come."""
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event is not None:
            yield event, json.loads(line[6:])
            event = None


async def test_the_logs_stream_gives_the_last_lines_then_each_new_line_as_it_is_written(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    demo = await box(fast("default", tenants={"app": app_tenant(tmp_path, "app")}))
    assert demo.proxy is not None
    admin, listener = proxy_of(demo).url("admin"), proxy_of(demo).url("app")
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    for path in ("/first.txt", "/hello.txt"):  # the file server logs each request to stderr
        await http.get(listener + path)
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: any("/hello.txt" in line for line in machine_of(demo, "app").controller.output()))

    async with asyncio.timeout(WAIT_S), http.stream("GET", admin + "/api/tenants/app/logs?lines=1") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = sse_events(r)
        event, data = await anext(frames)
        assert event == "line" and "GET /hello.txt" in data["line"], f"the last line first: {data}"
        await http.get(listener + "/written-after-connecting.txt")  # lines the app writes now (404: two)
        after: list[str] = []
        while not any("/written-after-connecting.txt" in line for line in after):
            event, data = await anext(frames)
            assert event == "line", (event, data)
            after.append(data["line"])
        assert not any("/hello.txt" in line for line in after), f"only the last line back (lines=1): {after}"
        await frames.aclose()


async def test_an_open_logs_stream_never_holds_up_the_proxys_stop(box: DemoFactory, http: httpx.AsyncClient,
                                                                   tmp_path: Path) -> None:
    demo = await box(fast("default", tenants={"app": app_tenant(tmp_path, "app")}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    async with http.stream("GET", admin + "/api/tenants/app/logs") as r:
        assert r.status_code == 200
        began = proxy_of(demo).clock.now()
        async with asyncio.timeout(WAIT_S):
            await demo.stop()
        took = proxy_of(demo).clock.now() - began
        assert took < 2.0, f"the stop waited {took:.2f} s for the open stream (drain is {proxy_of(demo).drain_s:g} s)"


async def test_the_logs_of_an_unknown_or_unstarted_kind_of_tenant_are_refused(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    demo = await box(fast("default", tenants={"app": app_tenant(tmp_path, "app")}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    missing = await http.get(admin + "/api/tenants/no-such-tenant/logs")
    assert missing.status_code == 404 and "no-such-tenant" in missing.json()["error"], missing.text
    other = await http.get(admin + "/api/tenants/ollama/logs")
    assert other.status_code == 409 and other.json()["reason"] == "not_lifecycle", other.text
    too_many = await http.get(admin + "/api/tenants/app/logs?lines=5000")
    assert too_many.status_code == 400 and "lines" in too_many.json()["error"], too_many.text


async def test_at_most_four_streams_follow_one_tenant_and_a_closed_one_frees_its_place(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    demo = await box(fast("default", tenants={"app": app_tenant(tmp_path, "app")}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    ctl = app_process(demo)
    async with contextlib.AsyncExitStack() as streams:
        for _ in range(4):
            r = await streams.enter_async_context(http.stream("GET", admin + "/api/tenants/app/logs"))
            assert r.status_code == 200
        fifth = await http.get(admin + "/api/tenants/app/logs")
        assert fifth.status_code == 429 and "4 streams already follow app" in fifth.json()["error"], fifth.text
        assert "app.log" in fifth.json()["fix"], "the log file is named as the way to read more"
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: ctl.followers == 0)
    async with http.stream("GET", admin + "/api/tenants/app/logs") as r:
        assert r.status_code == 200, "the places are given back when the streams end"


FLOOD = ("import http.server, sys\n"
         "line = b'x' * 1023 + b'\\n'\n"
         "for _ in range(24 * 1024): sys.stdout.buffer.write(line)\n"  # 24 MiB, as fast as it can, then it serves
         "sys.stdout.flush()\n"
         "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\n")


async def test_an_app_flooding_its_output_leaves_a_bounded_log_on_disk(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    tenant = process_tenant(port, tmp_path, release={"kind": "process", "stop_timeout_s": 2, "log_max_mib": 1,
                                                     "command": [PY, "-c", FLOOD, str(port)]})
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    started = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/start")
    assert started.status_code == 200, started.text  # it listens once its 24 MiB are written
    ctl = app_process(demo)
    log = ctl.log_path
    assert log is not None
    folder = log.parent

    def disk() -> int:
        return sum(p.stat().st_blocks * 512 for p in folder.glob("app.log*"))

    try:
        async with asyncio.timeout(WAIT_S * 3):
            await poll_until(lambda: ctl.logfile.cuts > 0 and disk() <= 2 * 2**20 + 2**16)
    except TimeoutError:
        raise AssertionError(f"{disk()} bytes of log on disk past its 1 MiB bound (twice, with .1): "
                             f"{sorted(p.name for p in folder.iterdir())}") from None


# -- stop-all ------------------------------------------------------------------------------------------

async def test_stop_all_stops_the_idle_ones_and_names_the_busy_one(box: DemoFactory, http: httpx.AsyncClient,
                                                                   tmp_path: Path) -> None:
    tenants = {name: app_tenant(tmp_path, name) for name in ("one", "two", "busy", "idle")}
    demo = await box(fast("default", tenants=tenants))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    for name in ("one", "two", "busy"):
        assert (await http.post(f"{admin}/api/tenants/{name}/start")).status_code == 200
    with proxy_of(demo).inflight.request("busy"):
        answer = await http.post(admin + "/api/tenants/stop")
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert body["ok"] is False and body["refused"] == ["busy"] and body["failed"] == [], body
    assert sorted(body["stopped"]) == ["idle", "one", "two"], body
    assert "busy (" in body["error"] and "never stopped" in body["error"], body["error"]
    results = {r["tenant"]: r for r in body["results"]}
    assert results["busy"]["reason"] == "busy" and results["busy"]["status"] == 409, results["busy"]
    assert results["idle"]["note"] and results["one"]["release"]["result"] in ("confirmed", "estimated"), results
    assert "ollama" not in results, "only the tenants the proxy starts"
    assert not port_open(upstream_port(demo, "one")) and not port_open(upstream_port(demo, "two"))
    assert port_open(upstream_port(demo, "busy")), "a busy tenant is never stopped"

    again = await http.post(admin + "/api/tenants/stop")
    assert again.status_code == 200 and again.json()["ok"] is True, again.text
    assert not port_open(upstream_port(demo, "busy"))


async def test_stop_all_needs_the_token_when_one_is_set(box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "stop-all-token")
    demo = await box(fast("default", tenants={"app": app_tenant(tmp_path, "app")}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    assert (await http.post(admin + "/api/tenants/stop")).status_code == 401
    assert (await http.post(admin + "/api/tenants/stop", headers={"Authorization": "Bearer wrong"})).status_code == 403
    ok = await http.post(admin + "/api/tenants/stop", headers={"Authorization": "Bearer stop-all-token"})
    assert ok.status_code == 200 and ok.json()["stopped"] == ["app"], ok.text
