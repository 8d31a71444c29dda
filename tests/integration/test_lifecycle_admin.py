"""The admin API's start and stop of a tenant the proxy starts and stops (a real `process` child on
the simulated box): the guards, the answers, the one release path, and the lifecycle in /api/tenants."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo import Demo
from tests.integration.boxes import DemoFactory, fast, free_port, port_open, process_tenant, proxy_of


async def app_box(box: DemoFactory, folder: Path, **extra: object) -> tuple[Demo, int]:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, folder, **extra)}))
    assert demo.proxy is not None
    return demo, port


async def test_admin_start_and_stop_run_the_app_and_answer_its_lifecycle(box: DemoFactory, http: httpx.AsyncClient,
                                                                         tmp_path: Path) -> None:
    demo, port = await app_box(box, tmp_path)
    admin = proxy_of(demo).url("admin")
    listed = {t["name"]: t for t in (await http.get(admin + "/api/tenants")).json()["tenants"]}
    assert listed["app"]["lifecycle"]["state"] == "stopped", listed["app"]
    assert listed["app"]["lifecycle"]["controller"]["kind"] == "process"
    assert listed["ollama"]["lifecycle"] is None, "a tenant the proxy does not start shows null"

    started = await http.post(admin + "/api/tenants/app/start")
    assert started.status_code == 200, started.text
    body = started.json()
    assert body["ok"] is True and body["action"] == "start" and body["lifecycle"]["state"] == "running", body
    assert body["report"]["ok"] is True and body["report"]["duration_s"] >= 0
    assert port_open(port), "the app answers once the start says running"
    again = (await http.post(admin + "/api/tenants/app/start")).json()
    assert again["note"] and "report" not in again, "a running tenant is not started twice"

    stopped = await http.post(admin + "/api/tenants/app/stop")
    assert stopped.status_code == 200, stopped.text
    body = stopped.json()
    assert body["lifecycle"]["state"] == "stopped" and body["release"]["result"] == "confirmed", body
    assert not port_open(port), "the app's port still answers after the stop"
    decisions = [(d.kind, d.trigger) for d in proxy_of(demo).decisions.recent() if d.kind in ("start", "stop", "release")]
    assert decisions == [("start", "lifecycle start"), ("release", "admin stop"), ("stop", "lifecycle stop")], \
        f"the stop goes through the one release path, recorded as a release: {decisions}"
    assert (await http.post(admin + "/api/tenants/app/stop")).json()["note"], "a stopped tenant is not stopped twice"


async def test_a_busy_tenant_is_never_stopped_by_the_admin(box: DemoFactory, http: httpx.AsyncClient,
                                                           tmp_path: Path) -> None:
    demo, port = await app_box(box, tmp_path)
    admin = proxy_of(demo).url("admin")
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
    with proxy_of(demo).inflight.request("app"):
        refused = await http.post(admin + "/api/tenants/app/stop")
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert body["reason"] == "busy" and "never stopped" in body["error"] and body["fix"], body
    assert body["lifecycle"]["state"] == "running" and port_open(port)


async def test_start_and_stop_refuse_tenants_the_proxy_does_not_start(box: DemoFactory, http: httpx.AsyncClient,
                                                                      tmp_path: Path) -> None:
    demo, _ = await app_box(box, tmp_path)
    admin = proxy_of(demo).url("admin")
    for name in ("ollama", "desktop"):
        for action in ("start", "stop"):
            r = await http.post(f"{admin}/api/tenants/{name}/{action}")
            assert r.status_code == 409, (name, action, r.text)
            assert r.json()["reason"] == "not_lifecycle" and r.json()["fix"], r.json()
    missing = await http.post(admin + "/api/tenants/no-such-tenant/start")
    assert missing.status_code == 404 and "no-such-tenant" in missing.json()["error"], missing.text


async def test_the_admin_start_of_a_failing_app_answers_503_and_skips_the_backoff(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    script = "import sys; print('error: out of memory', file=sys.stderr); sys.exit(3)"
    demo, _ = await app_box(box, tmp_path, start_timeout_s=5,
                            release={"kind": "process", "command": [sys.executable, "-c", script]})
    admin = proxy_of(demo).url("admin")
    first = await http.post(admin + "/api/tenants/app/start")
    assert first.status_code == 503, first.text
    body = first.json()
    assert body["reason"] == "start_failed" and "error: out of memory" in body["output"], body
    assert body["lifecycle"]["state"] == "failed" and body["lifecycle"]["failures"] == 1
    assert int(first.headers["retry-after"]) >= 1
    # A request now is refused by the backoff; the admin's start is tried at once.
    assert "next try is allowed" in (await http.get(proxy_of(demo).url("app") + "/hello.txt")).json()["error"]
    second = await http.post(admin + "/api/tenants/app/start")
    assert second.status_code == 503 and second.json()["lifecycle"]["failures"] == 2, second.text
    listed = (await http.get(admin + "/api/tenants/app")).json()["lifecycle"]
    assert listed["state"] == "failed" and listed["error"] and listed["retry_in_s"] is not None, listed


async def test_a_start_whose_memory_cannot_be_found_answers_507_like_a_request(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    demo, port = await app_box(box, tmp_path, needs_vram_gb=4096)
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/start")
    assert r.status_code == 507, r.text
    assert r.json()["tenant"] == "app" and "plan" in r.json() and r.json()["fix"], r.json()
    assert not port_open(port), "nothing was started"


async def test_start_and_stop_need_the_token_when_one_is_set(box: DemoFactory, http: httpx.AsyncClient,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "lifecycle-token")
    demo, port = await app_box(box, tmp_path)
    admin = proxy_of(demo).url("admin")
    for action in ("start", "stop"):
        assert (await http.post(f"{admin}/api/tenants/app/{action}")).status_code == 401
        r = await http.post(f"{admin}/api/tenants/app/{action}", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403
    foreign = await http.post(admin + "/api/tenants/app/start", headers={"Origin": "http://evil.example",
                                                                          "Authorization": "Bearer lifecycle-token"})
    assert foreign.status_code == 403, "a page on another origin cannot start an app"
    assert not port_open(port)
    ok = await http.post(admin + "/api/tenants/app/start", headers={"Authorization": "Bearer lifecycle-token"})
    assert ok.status_code == 200 and port_open(port), ok.text


async def test_metrics_count_starts_stops_and_failed_starts(box: DemoFactory, http: httpx.AsyncClient,
                                                             tmp_path: Path) -> None:
    port = free_port()
    bad = process_tenant(free_port(), tmp_path, release={"kind": "process", "command": [sys.executable, "-c", "exit(3)"]})
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path), "bad": bad}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")

    async def samples() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = (await http.get(admin + "/metrics")).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    app, failing = frozenset({("tenant", "app")}), frozenset({("tenant", "bad")})
    before = await samples()
    assert before[("hyperswap_lifecycle_starts_total", app)] == 0, "series exist at zero"
    assert before[("hyperswap_lifecycle_state", app | {("state", "stopped")})] == 1
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200  # a request starts it
    assert (await http.post(admin + "/api/tenants/app/stop")).status_code == 200
    assert (await http.post(admin + "/api/tenants/bad/start")).status_code == 503
    after = await samples()
    assert after[("hyperswap_lifecycle_starts_total", app)] == 1
    assert after[("hyperswap_lifecycle_start_seconds_count", app)] == 1
    assert after[("hyperswap_lifecycle_stops_total", app | {("result", "ok")})] == 1
    assert after[("hyperswap_lifecycle_state", app | {("state", "stopped")})] == 1
    assert after[("hyperswap_lifecycle_failed_starts_total", failing)] == 1
    assert after[("hyperswap_lifecycle_starts_total", failing)] == 0
    assert after[("hyperswap_lifecycle_state", failing | {("state", "failed")})] == 1
    assert ("hyperswap_lifecycle_state", frozenset({("tenant", "ollama"), ("state", "running")})) not in after


async def test_the_admin_stop_of_an_escalating_tenant_skips_the_soft_steps(box: DemoFactory, http: httpx.AsyncClient,
                                                                           tmp_path: Path) -> None:
    port = free_port()
    app = process_tenant(port, tmp_path)
    app["release"] = [{"kind": "http", "url": "/free", "timeout_s": 1}, app["release"]]
    demo = await box(fast("default", tenants={"app": app}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    stopped = await http.post(admin + "/api/tenants/app/stop")
    assert stopped.status_code == 200, stopped.text
    release = stopped.json()["release"]
    assert "stop" in release["asked"] and "steps" not in release, f"only the stopping step runs: {release}"
    assert not port_open(port)


async def test_a_stopped_tenant_shows_no_idle_countdown(box: DemoFactory, http: httpx.AsyncClient,
                                                         tmp_path: Path) -> None:
    """Issue 42: a stopped tenant still showed an idle-release countdown (nothing runs to release)."""
    demo = await box(fast("default", tenants={"app": process_tenant(free_port(), tmp_path, idle_release_after_s=600)}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")

    async def countdown() -> object:
        return (await http.get(admin + "/api/tenants/app")).json()["idle_release_in_s"]

    assert await countdown() is None, "never started: no countdown"
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    assert isinstance(await countdown(), float), "running: its idle release counts down"
    assert (await http.post(admin + "/api/tenants/app/stop")).status_code == 200
    assert await countdown() is None, "stopped: no countdown"


async def test_the_idle_ttl_stops_an_app_whose_release_list_starts_with_a_soft_step(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Issue 42: a release list [http, process] was never stopped by its ttl: the idle release ran the
    soft step first, which 'freed' what it could and ended the release there, so the app ran on for
    ever. The guide promises the ttl stops an app the proxy starts whatever it holds (llama-swap's
    ttl): only the stopping step runs, as for the admin's stop."""
    port = free_port()
    tenant = process_tenant(port, tmp_path, idle_release_after_s=0)
    process_step = tenant["release"]
    tenant["release"] = [{"kind": "http", "method": "GET", "url": "/hello.txt"}, process_step]
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    assert (await http.post(admin + "/api/tenants/app/start")).status_code == 200
    assert port_open(port)
    report = await proxy_of(demo).watchdog.tick()
    assert "app: idle release" in " ".join(report.actions), report.reasons.get("app")
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None and machine.state == "stopped", f"the ttl left the app {machine and machine.state}"
    assert not port_open(port)
