"""The dashboard tells a waiting request, a busy render and a request's whole story as they are
(issue 26): a chat waiting behind a render is "waiting", the render's job is counted, the decisions
are sentences, and the chat's waterfall shows its wait, the release, the load and the first byte."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from playwright.async_api import Page
from websockets.asyncio.client import connect as ws_connect

from proxy.demo import Demo, comfy_prompt, run_prompt
from proxy.sim.box import fast_scenario
from proxy.tasks import poll_until
from tests.browser.test_dashboard import HeldClock, wait_segment_above
from tests.integration.boxes import proxy_of

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]

WAIT_MS = 10_000
FLUX = "flux1-dev-fp8.safetensors"


def timed_loads() -> Any:
    """The fast box, its loads slow enough (tenths of a second) to be timed and recorded."""
    return fast_scenario("default", comfyui={"load_gbps": 20.0}, ollama={"load_gbps": 20.0})


async def test_a_chat_behind_a_render_is_waiting_the_render_busy_and_the_chats_story_drawn(
        box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box(timed_loads())
    assert demo.proxy is not None and demo.box.comfyui is not None
    page, console = await dashboard(demo)
    base = demo.proxy.url("comfyui")
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        await run_prompt(base, FLUX, http)  # the checkpoint is loaded: the next render only samples
        held = HeldClock(demo.box.comfyui.clock)
        demo.box.comfyui.clock = held  # its sampling steps wait for held.go
        cid = uuid.uuid4().hex
        async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}", max_queue=None) as ws:
            await ws.recv()
            r = await http.post(base + "/prompt", json={"prompt": comfy_prompt(FLUX), "client_id": cid})
            assert r.status_code == 200, r.text
            await poll_until(lambda: proxy_of(demo).inflight.traffic("comfyui").jobs, 0.01)
            chat = asyncio.ensure_future(http.post(demo.proxy.url("ollama") + "/api/generate",
                                                   json={"model": "gemma3:27b", "prompt": "hi", "stream": False}))
            ollama = page.locator('.card[data-tenant="ollama"]')
            await page.wait_for_selector('.card[data-tenant="ollama"][data-state="waiting"]', timeout=WAIT_MS)
            pill = await ollama.locator('[data-role="state"]').inner_text()
            assert pill.lower() == "waiting", f"a tenant whose only request waits is labelled {pill!r}"
            state = await ollama.locator('[data-role="state-text"]').inner_text()
            assert state.startswith("waiting for memory") and "in flight" not in state, state
            assert await ollama.locator('[data-role="in-flight"]').inner_text() == "1 waiting"

            comfy = page.locator('.card[data-tenant="comfyui"]')
            await page.wait_for_selector('.card[data-tenant="comfyui"][data-state="busy"]', timeout=WAIT_MS)
            flight = await comfy.locator('[data-role="in-flight"]').inner_text()
            assert flight == "1 job", f"a rendering ComfyUI shows in flight {flight!r}"
            idle = await comfy.locator('[data-role="idle-release"]').inner_text()
            assert idle.startswith("not while busy"), f"the idle release counts down during a render: {idle!r}"

            waiting = page.locator('#decisions li[data-kind="queued"]')
            await waiting.filter(has_text="waits for memory behind comfyui").wait_for(timeout=WAIT_MS)
            assert not chat.done()
            held.go.set()  # the render runs to its end
            assert (await chat).status_code == 200

    queued = page.locator('#decisions li[data-kind="queued"]').filter(has_text="then ran")
    await queued.wait_for(timeout=WAIT_MS)
    text = await queued.inner_text()
    assert "{" not in text and re.search(r"waited [\d.]+ s behind comfyui, then ran", text), text

    # The chat's story: waited N s behind comfyui, released comfyui in N s, loaded gemma3:27b in N s, first byte.
    story = page.locator('#stories li[data-tenant="ollama"]').filter(has_text="first byte after")
    await story.locator('[data-step="first_byte"]').wait_for(timeout=WAIT_MS)
    await story.locator('[data-step="load"]').wait_for(timeout=WAIT_MS)
    steps = [(await s.get_attribute("data-step"), await s.inner_text())
             for s in await story.locator(".step").all()]
    kinds = [k for k, _ in steps]
    assert kinds == ["wait", "release", "load", "first_byte"], steps
    texts = [t for _, t in steps]
    assert re.fullmatch(r"waited [\d.]+ s behind comfyui( \([\d.]+ s queued, then the release\))?", texts[0]), texts
    assert re.match(r"released comfyui in [\d.]+ s", texts[1]), texts
    assert re.fullmatch(r"loaded gemma3:27b in [\d.]+ s", texts[2]), texts
    assert re.fullmatch(r"first byte after [\d.]+ s", texts[3]), texts
    bars = [await story.locator(f'[data-step="{k}"] .bar').evaluate("b => parseFloat(b.style.left)") for k in kinds]
    assert bars == sorted(bars), f"the waterfall runs left to right: {bars}"
    assert not console.errors, console.errors


async def test_the_demos_model_sizes_and_load_speeds_are_the_models_and_health_stays_ok(
        box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box(timed_loads())
    assert demo.proxy is not None
    page, console = await dashboard(demo)
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:  # the chat-behind-a-render sequence
        await run_prompt(demo.proxy.url("comfyui"), FLUX, http)
        r = await http.post(demo.proxy.url("ollama") + "/api/generate",
                            json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
        assert r.status_code == 200, r.text
        await run_prompt(demo.proxy.url("comfyui"), FLUX, http)
    row = page.locator(f'#models tr[data-model="comfyui:{FLUX}"]')
    await row.wait_for(timeout=WAIT_MS)
    size = await row.locator("td").nth(2).inner_text()
    assert size == "11.9 GiB", f"the 11.9 GiB flux checkpoint shows as {size} (the 1/1024 stand-in's size)"
    load = page.locator('#decisions li[data-kind="model_load"]').filter(has_text=FLUX).first
    await load.wait_for(timeout=WAIT_MS)
    shown = re.search(r"= ([\d.]+) GB/s", await load.inner_text())
    assert shown is not None
    gbps = float(shown.group(1))
    assert gbps > 5, f"the stand-in's speed shown: {gbps} GB/s for a box that loads at 20 GB/s"
    health = (await (await page.request.get(demo.proxy.url("admin") + "/api/health")).json())["entries"]
    speed = [e for e in health if e["name"] == "model load speed"]
    assert not speed, f"the demo's own stand-ins make the load speed degraded: {speed}"
    assert not console.errors, console.errors


async def test_a_narrow_segments_label_is_never_clipped(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box(timed_loads())
    assert demo.proxy is not None
    page, console = await dashboard(demo)
    await page.set_viewport_size({"width": 700, "height": 900})
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:
        r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                            json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
        assert r.status_code == 200, r.text
    await wait_segment_above(page, "ollama", 1024**3)
    await page.wait_for_timeout(600)  # the bar's segments grow to their width (a .4 s transition)
    clipped = await page.evaluate(
        "() => [...document.querySelectorAll('#membar .seg')].filter((s) => s.textContent"
        " && s.scrollWidth > s.clientWidth + 1).map((s) => `${s.textContent}: ${s.scrollWidth} > ${s.clientWidth}`)")
    assert not clipped, f"labels clipped in the memory bar: {clipped}"
    labelled = await page.locator("#membar .seg", has_text="GiB").count()
    assert labelled >= 1, "wide segments keep their labels"
    assert not console.errors, console.errors
