"""Every request to a stopped app is answered (issue 33, items 4 and 5): empty bodies, chunked
bodies, HEAD and websockets reach an app the proxy starts for them, or get a refusal that says why;
requests that only read do not start it (a poll never makes an app flap)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect as ws_connect
from websockets.typing import Origin

from proxy.clock import ManualClock
from proxy.demo import Demo, describe
from proxy.lifecycle.state import TenantLifecycle
from proxy.relay import departure
from proxy.sim.box import Scenario
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, fast, free_port, process_tenant, proxy_of

ANSWER_WITHIN_S = 20.0  # far more than a start of the fast relay takes; a hang fails the test, never stalls it


def lifecycle(**stt: object) -> Scenario:
    """The fast lifecycle scenario with these settings of its speech relay's tenant (`stt`)."""
    tenants = dict(fast("lifecycle").tenants)
    return fast("lifecycle", tenants={**tenants, "stt": {**tenants["stt"], **stt}})


async def stopped_relay(box: DemoFactory, **stt: object) -> tuple[Demo, TenantLifecycle, str]:
    """The lifecycle scenario's speech relay, stopped (nothing started it yet): (demo, machine, its URL)."""
    demo = await box(lifecycle(**stt))
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("stt")
    assert machine is not None and machine.state == "stopped"
    return demo, machine, proxy_of(demo).url("stt")


async def test_an_empty_body_post_to_a_stopped_app_is_answered(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported hang: `curl --data-binary @missing.wav` sends an empty POST; the app started and
    the request was never answered. The departure watcher (armed once a request lasts WATCH_AFTER_S,
    which any start does) read the request's one empty body message, and the body reader then waited
    for a message that never came. WATCH_AFTER_S 0 makes the race certain instead of timing-bound."""
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 0.0)
    _, machine, url = await stopped_relay(box)
    async with asyncio.timeout(ANSWER_WITHIN_S):
        said = await http.post(url + "/v1/audio/transcriptions", content=b"")
    assert said.status_code == 200 and said.json()["bytes"] == 0, said.text
    assert machine.state == "running"


async def test_a_chunked_body_to_a_stopped_app_is_started_and_forwarded(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 0.0)
    _, machine, url = await stopped_relay(box)

    async def audio() -> AsyncIterator[bytes]:
        yield b"RIFF"
        yield bytes(996)

    async with asyncio.timeout(ANSWER_WITHIN_S):
        said = await http.post(url + "/v1/audio/transcriptions", content=audio())
    assert said.status_code == 200 and said.json()["bytes"] == 1000, said.text
    assert machine.state == "running"


async def test_a_read_of_a_stopped_app_is_answered_503_with_the_reason_and_does_not_start_it(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo, machine, url = await stopped_relay(box)
    for method in ("GET", "HEAD", "OPTIONS"):
        async with asyncio.timeout(ANSWER_WITHIN_S):
            r = await http.request(method, url + "/health")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (method, r.status_code, r.text)
        assert machine.state == "stopped", f"a {method} started the app"
    body = (await http.get(url + "/v1/models")).json()
    assert body["state"] == "stopped" and body["wake_on"] == "writes", body
    assert "does not start it" in body["error"] and "/api/tenants/stt/start" in body["fix"], body
    assert not [d for d in proxy_of(demo).decisions.recent() if d.kind == "start"], "a read was recorded as a start"


async def test_wake_on_any_lets_a_read_start_it_and_the_start_counts_as_activity(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    clock = ManualClock(ticking=True)
    demo = await box(lifecycle(wake_on="any", idle_release_after_s=4.0), clock=clock)
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("stt")
    assert machine is not None
    await clock.advance(60.0)  # long idle before the first request: the ttl must count from the start, not before
    r = await http.get(proxy_of(demo).url("stt") + "/health")
    assert r.status_code == 200 and machine.state == "running", r.text
    deadline = proxy_of(demo).watchdog.idle_deadline("stt")
    assert deadline is not None and deadline >= clock.now() + 3.0, \
        f"the start is no activity: idle release due {deadline and deadline - clock.now():.1f} s from now"


async def test_polling_reads_never_make_a_stopped_app_flap(box: DemoFactory, http: httpx.AsyncClient) -> None:
    """The reported flap: a client polling once a second against a ttl of 4 s started the app 4 times
    and stopped it 3 times in 40 s. Now: started once (by the request that needed it), stopped once by
    the ttl, and the 40 polls answered, none of them starting it again."""
    clock = ManualClock(ticking=True)
    demo = await box(lifecycle(idle_release_after_s=4.0), clock=clock)
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("stt")
    assert machine is not None
    url = proxy_of(demo).url("stt")
    said = await http.post(url + "/v1/audio/transcriptions", content=b"RIFF")
    assert said.status_code == 200 and machine.state == "running", said.text
    statuses = []
    for _ in range(40):
        async with asyncio.timeout(ANSWER_WITHIN_S):
            statuses.append((await http.get(url + "/health")).status_code)
            await proxy_of(demo).watchdog.tick()
            await poll_until(lambda: machine.state in ("running", "stopped"))
        await clock.advance(1.0)
    kinds = [d.kind for d in proxy_of(demo).decisions.recent(500) if d.tenant == "stt" and d.kind in ("start", "stop")]
    assert kinds.count("start") <= 1, f"the polls started the app again: {kinds}"
    assert kinds == ["start", "stop"] and machine.state == "stopped", f"the ttl did not stop the idle app: {kinds}"
    assert set(statuses) <= {200, 503} and statuses[0] == 200 and statuses[-1] == 503, statuses


async def test_a_cross_origin_request_never_wakes_a_stopped_app(box: DemoFactory, http: httpx.AsyncClient) -> None:
    """A web page elsewhere can POST text/plain anywhere without a preflight: it must not start the app.
    The listener's own address as Origin (its web UI) does."""
    _, machine, url = await stopped_relay(box)
    r = await http.post(url + "/v1/audio/transcriptions", content=b"x",
                        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and machine.state == "stopped", r.text
    assert "another origin" in r.json()["error"], r.json()
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with ws_connect(url.replace("http://", "ws://") + "/ws", origin=Origin("https://evil.example")):
            pass
    assert refused.value.response.status_code == 403 and machine.state == "stopped"
    own = await http.post(url + "/v1/audio/transcriptions", content=b"x", headers={"Origin": url})
    assert own.status_code == 200 and machine.state == "running", own.text


async def test_a_websocket_to_a_stopped_app_starts_it_and_gets_the_apps_own_answer(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    """The relay serves no websocket: the upgrade starts it and its own 404 comes back as the refusal."""
    _, machine, url = await stopped_relay(box)
    async with asyncio.timeout(ANSWER_WITHIN_S):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with ws_connect(url.replace("http://", "ws://") + "/ws"):
                pass
    assert refused.value.response.status_code == 404 and machine.state == "running"


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


async def test_a_started_app_never_inherits_the_proxys_secrets_and_its_own_env_wins(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33, item 6: the admin token (HYPERSWAP_ADMIN_TOKEN, or whatever admin.token_env names)
    is not in the environment of an app the proxy starts; tenants.json's env is applied last."""
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "tok-default-variable")
    monkeypatch.setenv("MY_ADMIN_TOKEN", "tok-named-variable")
    monkeypatch.setenv("HYPERSWAP_CONFIG", str(tmp_path / "tenants.json"))
    monkeypatch.setenv("SOME_SETTING", "inherited")
    tenant = process_tenant(free_port(), tmp_path)
    tenant["release"] = {**tenant["release"], "env": {"HYPERSWAP_FOR_THE_APP": "given", "SOME_SETTING": "overridden"}}
    demo = await box(fast("default", tenants={"app": tenant}, settings={"admin": {"token_env": "MY_ADMIN_TOKEN"}}))
    assert demo.proxy is not None
    assert (await http.get(proxy_of(demo).url("app") + "/hello.txt")).status_code == 200
    machine = proxy_of(demo).broker.lifecycles.machine("app")
    assert machine is not None
    pid = machine.controller.describe()["pid"]
    assert isinstance(pid, int)
    env = environ(pid)
    leaked = {k: v for k, v in env.items() if v.startswith("tok-") or k in ("HYPERSWAP_ADMIN_TOKEN", "MY_ADMIN_TOKEN",
                                                                     "HYPERSWAP_CONFIG")}
    assert not leaked, f"the proxy's secrets reached the app: {sorted(leaked)}"
    assert env["HYPERSWAP_FOR_THE_APP"] == "given" and env["SOME_SETTING"] == "overridden", "tenants.json's env wins"
    assert env.get("PATH") == os.environ["PATH"], "the rest of the proxy's environment is inherited"


async def test_the_lifecycle_demos_try_lines_answer_as_pasted(box: DemoFactory) -> None:
    """Each `curl` line `hyperswap demo --scenario lifecycle` prints runs as pasted in a shell: it
    names no file a newcomer lacks, and answers (the read of the stopped relay: its 503, on purpose)."""
    demo = await box("lifecycle")
    lines = describe(demo, "lifecycle").split("Try:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    commands = [line.strip().split("  #", 1)[0].strip() for line in lines if line.strip().startswith("curl")]
    assert len(commands) >= 6 and any("transcriptions" in c for c in commands), lines
    env = {**os.environ, "no_proxy": "*", "NO_PROXY": "*"}
    for command in commands:
        proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.STDOUT, env=env)
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
        text = out.decode()
        assert proc.returncode == 0 and "Warning" not in text, f"{command}\n -> {proc.returncode}: {text[:500]}"
        if "-si " in command:
            assert text.startswith("HTTP/1.1 503") and '"state":"stopped"' in text, f"{command}\n -> {text[:500]}"
        elif "json.tool" not in command:  # one JSON answer, or a streamed one's lines (the chat's, with its steps)
            bodies = [json.loads(line) for line in text.splitlines() if line.strip()] if "-sN " in command \
                else [json.loads(text)]
            assert bodies and not any("error" in b for b in bodies), f"{command}\n -> {text[:500]}"


async def test_a_body_too_large_to_keep_still_starts_a_stopped_app_first(box: DemoFactory, http: httpx.AsyncClient) -> None:
    """A body past replay_body_max_mb is planned on its head and streamed through (no OOM retry): its app must still be
    started before it, since the wake moved after the body's read (a streamed request hears the start)."""
    _, machine, url = await stopped_relay(box, replay_body_max_mb=0.001)
    async with asyncio.timeout(ANSWER_WITHIN_S):
        said = await http.post(url + "/v1/audio/transcriptions", content=bytes(5000))
    assert said.status_code == 200 and said.json()["bytes"] == 5000, said.text
    assert machine.state == "running"
