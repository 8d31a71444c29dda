"""Tenants the proxy stops and starts (release kind `process`), with a real child process: started
on the first request to its listener, stopped by a release, started again by the next request."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from proxy.demo import Demo, comfy_prompt
from proxy.handoff.decisions import DecisionView
from proxy.lifecycle.state import TenantLifecycle
from proxy.sim.gpu import GIB
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, fast, free_port, port_open, process_tenant, proxy_of


async def test_a_process_tenant_starts_on_its_first_request_stops_on_release_and_starts_again(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None and machine.state == "stopped", "nothing runs before the first request"

    first = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert first.status_code == 200 and first.text == "hello from the app\n", first.text
    assert machine.state == "running"
    starts = [d for d in proxy_of(demo).decisions.recent() if d.kind == "start"]
    assert len(starts) == 1 and starts[0].outcome["ok"] is True

    released = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/release")
    assert released.status_code == 200, released.text
    assert machine.state == "stopped"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the app's port still answers after its stop"

    again = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert again.status_code == 200 and machine.state == "running"
    assert [d.kind for d in proxy_of(demo).decisions.recent() if d.kind in ("start", "stop")] == ["start", "stop", "start"]


async def test_concurrent_requests_share_one_start(box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    import asyncio

    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    answers = await asyncio.gather(*(http.get(proxy_of(demo).url("app") + "/hello.txt") for _ in range(5)))
    assert [a.status_code for a in answers] == [200] * 5
    assert len([d for d in proxy_of(demo).decisions.recent() if d.kind == "start"]) == 1


async def test_a_start_that_fails_answers_503_with_the_apps_last_lines(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    port = free_port()
    script = "import sys; print('loading model /models/q.gguf'); print('error: out of memory', file=sys.stderr); sys.exit(3)"
    tenant = process_tenant(port, tmp_path)
    tenant["release"] = {"kind": "process", "command": [sys.executable, "-c", script]}
    tenant["start_timeout_s"] = 5
    demo = await box(fast("default", tenants={"app": tenant}))
    assert demo.proxy is not None
    answer = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert "could not be started" in body["error"] and "error: out of memory" in body["output"], body
    assert int(answer.headers["retry-after"]) >= 1
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None and machine.state == "failed"
    again = await http.get(proxy_of(demo).url("app") + "/hello.txt")
    assert again.status_code == 503 and "next try is allowed" in again.json()["error"], "backs off before trying again"


async def test_the_proxy_stops_what_it_started_when_it_stops(box: DemoFactory, http: httpx.AsyncClient,
                                                             tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    assert demo.proxy is not None
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
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
        first = await http.get(proxy_of(demo).url("vllm") + "/v1/models")
        assert first.status_code == 200 and calls == ["models"], "awake: nothing is called before it"
        released = await http.post(proxy_of(demo).url("admin") + "/api/tenants/vllm/release")
        assert released.status_code == 200 and calls[-1] == "sleep", released.text
        answers = await asyncio.gather(*(http.get(proxy_of(demo).url("vllm") + "/v1/models") for _ in range(3)))
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert calls.count("wake_up") == 1 and calls.index("wake_up") < calls.index("models", 2), \
            "woken once, before the first request after the release reached it"
        assert [d.kind for d in proxy_of(demo).decisions.recent() if d.kind == "resume"] == ["resume"]
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
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
    released = await http.post(proxy_of(demo).url("admin") + "/api/tenants/app/release")
    assert released.status_code == 200, released.text
    steps = released.json()["steps"]
    assert [(s["step"], s["kind"]) for s in steps] == [(0, "http"), (1, "process")], steps
    assert steps[0]["result"] == "error" and "501" in steps[0]["error"], "the soft step was tried first and failed"
    assert steps[1]["result"] in ("confirmed", "estimated"), "then the app was stopped"
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None and machine.state == "stopped" and not port_open(port)
    (decision,) = [d for d in proxy_of(demo).decisions.recent() if d.kind == "release" and d.tenant == "app"]
    assert [s["kind"] for s in decision.outcome["releases"][0]["steps"]] == ["http", "process"]


# -- the speech relay of the `lifecycle` scenario: a real child holding simulated memory -----------

FLUX = "flux1-dev-fp8.safetensors"  # needs the relay's memory on the lifecycle scenario's 16 GiB card


async def relay_box(box: DemoFactory, http: httpx.AsyncClient) -> tuple[Demo, TenantLifecycle, int]:
    """The lifecycle scenario with the speech relay started by a first request (a POST: a read does
    not start it): (demo, its state
    machine, the relay's pid)."""
    demo = await box("lifecycle")
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("stt")
    assert machine is not None and machine.state == "stopped"
    said = await http.post(proxy_of(demo).url("stt") + "/v1/audio/transcriptions", content=b"RIFF")
    assert said.status_code == 200 and machine.state == "running", said.text
    pid = machine.controller.describe()["pid"]
    assert isinstance(pid, int) and pid in demo.box.gpu.real_pids(), "the running relay holds memory on the card"
    return demo, machine, pid


def decisions(demo: Demo, kind: str, tenant: str) -> list[DecisionView]:
    assert demo.proxy is not None
    return [d for d in proxy_of(demo).decisions.recent(500) if d.kind == kind and d.tenant == tenant]


async def prompt(demo: Demo, http: httpx.AsyncClient, ckpt: str = FLUX) -> httpx.Response:
    assert demo.proxy is not None
    return await http.post(proxy_of(demo).url("comfyui") + "/prompt", json={"prompt": comfy_prompt(ckpt)})


async def rendered(demo: Demo, http: httpx.AsyncClient, answer: httpx.Response) -> None:
    """Wait for the queued prompt's end in ComfyUI's own history; it must have succeeded (a render
    forwarded before the memory was back runs out of it)."""
    assert answer.status_code == 200, answer.text
    prompt_id = answer.json()["prompt_id"]
    url = f"{demo.box.servers['comfyui'].url}/history/{prompt_id}"

    async def ended() -> dict[str, Any]:
        return dict((await http.get(url)).json())
    async with asyncio.timeout(20):
        await poll_until(ended, 0.02)
    status = (await ended())[prompt_id]["status"]
    assert status["status_str"] == "success", f"the render failed: {[m[0] for m in status['messages']]}"


async def test_a_render_that_needs_the_relays_memory_stops_it_and_runs_once_the_card_shows_it_back(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo, machine, pid = await relay_box(box, http)
    gpu = demo.box.gpu
    comfy = demo.box.comfyui
    assert comfy is not None and comfy.pid is not None
    assert gpu.free_bytes() + gpu.used_by(comfy.pid) < 14 * GIB, "the render (14 GiB) needs the relay's memory"

    await rendered(demo, http, await prompt(demo, http))

    stops = decisions(demo, "stop", "stt")
    assert len(stops) == 1 and stops[0].outcome["ok"] is True, [d.outcome for d in stops]
    assert machine.state == "stopped" and pid not in gpu.real_pids(), "the relay's process is gone from the card"
    plan = decisions(demo, "plan", "comfyui")[-1]
    released = plan.outcome["releases"]
    assert [r["tenant"] for r in released] == ["stt"] and released[0]["confirmed"] is True, released
    assert released[0]["freed_bytes"] == 3 * GIB, "confirmed on the card: all the relay held came back"


async def test_the_next_request_to_a_stopped_relay_starts_it_again(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo, machine, first_pid = await relay_box(box, http)
    await rendered(demo, http, await prompt(demo, http))
    assert machine.state == "stopped"
    assert demo.proxy is not None

    said = await http.post(proxy_of(demo).url("stt") + "/v1/audio/transcriptions", content=b"RIFF" + bytes(1000))
    assert said.status_code == 200 and said.json()["bytes"] == 1004, said.text
    assert machine.state == "running"
    starts = decisions(demo, "start", "stt")
    assert [d.outcome["ok"] for d in starts] == [True, True], [d.outcome for d in starts]
    pid = machine.controller.describe()["pid"]
    assert pid != first_pid and pid in demo.box.gpu.real_pids(), "a new relay process holds the memory again"


async def test_a_relay_transcribing_is_not_stopped_the_render_waits_and_runs_after(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    """A transcription in flight (its audio still uploading) makes the relay busy: the render that
    needs its memory waits in the queue; once the transcription is answered, the relay is stopped and
    the render runs."""
    demo, machine, pid = await relay_box(box, http)
    assert demo.proxy is not None
    uploading, sent = asyncio.Event(), asyncio.Event()

    async def audio() -> AsyncIterator[bytes]:
        yield b"RIFF" + bytes(1000)
        sent.set()
        await uploading.wait()
        yield bytes(1000)

    transcribing = asyncio.ensure_future(http.post(proxy_of(demo).url("stt") + "/v1/audio/transcriptions", content=audio()))
    async with asyncio.timeout(20):
        await sent.wait()
        # still uploading, so not admitted yet (not GPU work): open on a tenant a stop would cut, so busy
        await poll_until(lambda: proxy_of(demo).inflight.connections("stt") > 0)
    rendering = asyncio.ensure_future(prompt(demo, http))
    async with asyncio.timeout(20):
        await poll_until(lambda: any(w["tenant"] == "comfyui" and w["waiting_for"]  # planned, not only arrived
                                     for w in proxy_of(demo).broker.scheduler.waiting()))
    waiting = next(w for w in proxy_of(demo).broker.scheduler.waiting() if w["tenant"] == "comfyui")
    assert "stt" in waiting["waiting_for"], waiting
    assert not rendering.done() and machine.state == "running" and pid in demo.box.gpu.real_pids()
    assert not decisions(demo, "stop", "stt"), "a busy relay was stopped"

    uploading.set()
    said = await transcribing
    assert said.status_code == 200 and said.json()["bytes"] == 2004, said.text
    async with asyncio.timeout(20):
        await rendered(demo, http, await rendering)
    assert machine.state == "stopped" and [d.outcome["ok"] for d in decisions(demo, "stop", "stt")] == [True]


async def test_a_relay_with_a_stream_open_is_not_stopped_the_render_waits_and_runs_after(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    """An open captions stream (a GET: no GPU request, but a stop would cut it) keeps the relay
    running; the render waits without trying the stop over and over, and runs once the stream ends."""
    demo, machine, pid = await relay_box(box, http)
    assert demo.proxy is not None
    async with http.stream("GET", proxy_of(demo).url("stt") + "/v1/captions?segments=0&interval_s=0.02") as stream:
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data: "), "the stream flows through the proxy"
        rendering = asyncio.ensure_future(prompt(demo, http))
        async with asyncio.timeout(20):
            await poll_until(lambda: any(w["tenant"] == "comfyui" for w in proxy_of(demo).broker.scheduler.waiting()))
        # a few passes of the scheduler, on the proxy's own clock
        for _ in range(3):
            await anext(lines)
        assert not rendering.done() and machine.state == "running" and pid in demo.box.gpu.real_pids()
        plans = decisions(demo, "plan", "comfyui")
        assert len(plans) <= 1, f"the refused stop was tried again and again: {len(plans)} release plans"
        assert not [d for d in decisions(demo, "stop", "stt") if d.outcome["ok"]], "the relay was stopped under a stream"
    async with asyncio.timeout(20):
        await rendered(demo, http, await rendering)
    assert machine.state == "stopped" and pid not in demo.box.gpu.real_pids()
