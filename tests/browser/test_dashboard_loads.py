"""The dashboard shows a load while it happens (issue 36): the loading tenant's card says
"loading <model>, X of Y GiB, N s" and the header names the load, until the engine answers."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from playwright.async_api import Page

from proxy.demo import Demo
from proxy.sim.box import fast_scenario
from tests.browser.test_dashboard import HeldClock

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]

WAIT_MS = 10_000
MODEL = "gemma3:27b"


async def test_a_load_shows_on_the_dashboard_with_the_models_name_while_it_happens(
        box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box(fast_scenario("default"))
    assert demo.proxy is not None and demo.box.ollama is not None
    held = HeldClock(demo.box.ollama.load_clock, free=2)  # two of its four allocation steps, then held
    demo.box.ollama.load_clock = held
    page, console = await dashboard(demo)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        chat = asyncio.ensure_future(http.post(demo.proxy.url("ollama") + "/api/generate",
                                               json={"model": MODEL, "prompt": "hi", "stream": False}))
        try:
            loading = page.locator('.card[data-tenant="ollama"] [data-role="loading"]')
            # a frame taken after the second allocation step shows memory on the card
            shown = loading.filter(has_text=re.compile(r"[1-9][\d.]* GiB of"))
            await shown.wait_for(timeout=WAIT_MS)
            text = await shown.inner_text()
            assert re.fullmatch(rf"{re.escape(MODEL)}, [\d.]+ GiB of 1\d\.\d GiB( \(estimated\))?, [\d.]+ s", text), text
            assert await loading.get_attribute("data-model") == MODEL
            state = await page.locator('.card[data-tenant="ollama"] [data-role="state-text"]').inner_text()
            assert state == f"loading {MODEL}", f"the card's state during the load reads {state!r}"
            assert f"loading {MODEL} (ollama)" in await page.locator("#device").inner_text()
            assert not chat.done(), "the load was held while the page was read"
        finally:
            held.go.set()
        assert (await chat).status_code == 200
    await loading.wait_for(state="detached", timeout=WAIT_MS)  # answered: on the card, no longer loading
    assert not console.errors, console.errors
