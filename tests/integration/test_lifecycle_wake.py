"""Every request to a stopped app is answered (issue 33, items 4 and 5): empty bodies, chunked
bodies, HEAD and websockets reach an app the proxy starts for them, or get a refusal that says why;
requests that only read do not start it (a poll never makes an app flap)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from boxes import DemoFactory, fast

from proxy.demo import Demo
from proxy.lifecycle.state import TenantLifecycle
from proxy.relay import departure

ANSWER_WITHIN_S = 20.0  # far more than a start of the fast relay takes; a hang fails the test, never stalls it


async def stopped_relay(box: DemoFactory, **stt: object) -> tuple[Demo, TenantLifecycle, str]:
    """The lifecycle scenario's speech relay, stopped (nothing started it yet): (demo, machine, its URL)."""
    demo = await box(fast("lifecycle", tenants={"stt": dict(stt)}) if stt else fast("lifecycle"))
    assert demo.proxy is not None
    machine = demo.proxy.arbitration.lifecycles.machine("stt")
    assert machine is not None and machine.state == "stopped"
    return demo, machine, demo.proxy.url("stt")


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
