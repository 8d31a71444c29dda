"""Tenants the proxy stops and starts (release kind `process`), with a real child process: started
on the first request to its listener, stopped by a release, started again by the next request."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import httpx
from boxes import DemoFactory, fast, free_port, port_open, process_tenant

from proxy.tasks import poll_until


async def test_a_process_tenant_starts_on_its_first_request_stops_on_release_and_starts_again(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    machine = demo.proxy.arbitration.lifecycles.machine("app")
    assert machine is not None and machine.state == "stopped", "nothing runs before the first request"

    first = await http.get(demo.proxy.url("app") + "/hello.txt")
    assert first.status_code == 200 and first.text == "hello from the app\n", first.text
    assert machine.state == "running"
    starts = [d for d in demo.proxy.decisions.recent() if d.kind == "start"]
    assert len(starts) == 1 and starts[0].outcome["ok"] is True

    released = await http.post(demo.proxy.url("admin") + "/api/tenants/app/release")
    assert released.status_code == 200, released.text
    assert machine.state == "stopped"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the app's port still answers after its stop"

    again = await http.get(demo.proxy.url("app") + "/hello.txt")
    assert again.status_code == 200 and machine.state == "running"
    assert [d.kind for d in demo.proxy.decisions.recent() if d.kind in ("start", "stop")] == ["start", "stop", "start"]


async def test_concurrent_requests_share_one_start(box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    import asyncio

    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    answers = await asyncio.gather(*(http.get(demo.proxy.url("app") + "/hello.txt") for _ in range(5)))
    assert [a.status_code for a in answers] == [200] * 5
    assert len([d for d in demo.proxy.decisions.recent() if d.kind == "start"]) == 1


async def test_a_start_that_fails_answers_503_with_the_apps_last_lines(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    script = "import sys; print('loading model /models/q.gguf'); print('error: out of memory', file=sys.stderr); sys.exit(3)"
    tenant = process_tenant(port, tmp_path)
    tenant["release"] = {"kind": "process", "command": [sys.executable, "-c", script]}
    tenant["start_timeout_s"] = 5
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    answer = await http.get(demo.proxy.url("app") + "/hello.txt")
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert "could not be started" in body["error"] and "error: out of memory" in body["output"], body
    assert int(answer.headers["retry-after"]) >= 1
    machine = demo.proxy.arbitration.lifecycles.machine("app")
    assert machine is not None and machine.state == "failed"
    again = await http.get(demo.proxy.url("app") + "/hello.txt")
    assert again.status_code == 503 and "next try is allowed" in again.json()["error"], "backs off before trying again"


async def test_the_proxy_stops_what_it_started_when_it_stops(box: DemoFactory, http: httpx.AsyncClient,
                                                             tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    assert (await http.get(demo.proxy.url("app") + "/hello.txt")).status_code == 200
    await demo.stop()

    def closed() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0
    await poll_until(closed)


async def test_a_soft_release_with_resume_wakes_the_app_before_its_next_request(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    """vLLM's shape: release = POST /sleep, resume = POST /wake_up, called once before the next request
    is forwarded (and not before a request that came while it was awake)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from proxy.relay.servers import start_server

    calls: list[str] = []
    asleep = [False]

    async def sleep(request: Request) -> JSONResponse:
        calls.append("sleep")
        asleep[0] = True
        return JSONResponse({})

    async def wake_up(request: Request) -> JSONResponse:
        calls.append("wake_up")
        asleep[0] = False
        return JSONResponse({})

    async def models(request: Request) -> JSONResponse:
        calls.append("models")
        return JSONResponse({"asleep": asleep[0]}, status_code=503 if asleep[0] else 200)

    app = Starlette(routes=[Route("/sleep", sleep, methods=["POST"]), Route("/wake_up", wake_up, methods=["POST"]),
                            Route("/v1/models", models)])
    server = await start_server(app, name="vllm")
    try:
        tenant = {"engine": "generic", "listen": f"127.0.0.1:{free_port()}", "upstream": server.url,
                  "match": {"process_names": [], "cmdline_patterns": ["vllm serve"]}, "priority": 30,
                  "needs_vram_gb": 1.0, "release": {"kind": "http", "url": "/sleep", "resume": {"url": "/wake_up"}}}
        demo = await box(fast("default", tenants={"vllm": tenant}))
        assert demo.proxy is not None
        first = await http.get(demo.proxy.url("vllm") + "/v1/models")
        assert first.status_code == 200 and calls == ["models"], "awake: nothing is called before it"
        released = await http.post(demo.proxy.url("admin") + "/api/tenants/vllm/release")
        assert released.status_code == 200 and calls[-1] == "sleep", released.text
        answers = await asyncio.gather(*(http.get(demo.proxy.url("vllm") + "/v1/models") for _ in range(3)))
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert calls.count("wake_up") == 1 and calls.index("wake_up") < calls.index("models", 2), \
            "woken once, before the first request after the release reached it"
        assert [d.kind for d in demo.proxy.decisions.recent() if d.kind == "resume"] == ["resume"]
    finally:
        await server.stop()


async def test_a_release_escalates_step_by_step_and_the_decision_says_which_step_did_what(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    """release = [POST /free on the app (Python's http.server answers 501 to a POST), then stop it]:
    the first step fails, the second stops the app; both are in the release's steps, in order."""
    port = free_port()
    tenant = process_tenant(port, tmp_path)
    stop = tenant["release"]
    tenant["release"] = [{"kind": "http", "url": "/free", "timeout_s": 1}, stop]
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    assert (await http.get(demo.proxy.url("app") + "/hello.txt")).status_code == 200
    released = await http.post(demo.proxy.url("admin") + "/api/tenants/app/release")
    assert released.status_code == 200, released.text
    steps = released.json()["steps"]
    assert [(s["step"], s["kind"]) for s in steps] == [(0, "http"), (1, "process")], steps
    assert steps[0]["result"] == "error" and "501" in steps[0]["error"], "the soft step was tried first and failed"
    assert steps[1]["result"] in ("confirmed", "estimated"), "then the app was stopped"
    machine = demo.proxy.arbitration.lifecycles.machine("app")
    assert machine is not None and machine.state == "stopped" and not port_open(port)
    (decision,) = [d for d in demo.proxy.decisions.recent() if d.kind == "release" and d.tenant == "app"]
    assert [s["kind"] for s in decision.outcome["releases"][0]["steps"]] == ["http", "process"]
