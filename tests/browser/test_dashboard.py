"""The dashboard in Debian's Chromium against the simulated box: what an operator sees and clicks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import BrowserContext, Dialog, Page
from websockets.asyncio.client import connect as ws_connect

from proxy.admin.telemetry import Telemetry
from proxy.clock import Clock
from proxy.config.units import GIB
from proxy.demo import Demo, comfy_prompt, run_prompt
from proxy.gpu.snapshot import GpuReadError
from proxy.handoff.decisions import OomRetry, Rejected
from proxy.handoff.plan import Blocker, Plan
from proxy.sim.box import fast_scenario as fast
from proxy.tasks import poll_until
from tests.integration.boxes import ollama_of, proxy_of

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]

WAIT_MS = 10_000


async def segment_bytes(page: Page, key: str) -> int:
    return int(await page.get_attribute(f'#membar [data-segment="{key}"]', "data-bytes") or "0")


async def wait_segment_above(page: Page, key: str, floor: int) -> None:
    await page.wait_for_function(
        "([key, floor]) => { const s = document.querySelector(`#membar [data-segment=\"${key}\"]`);"
        " return s && Number(s.dataset.bytes) > floor; }", arg=[key, floor], timeout=WAIT_MS)


async def test_page_loads_clean_and_shows_every_tenant_of_the_scenario(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    page, console = await dashboard(demo)
    for name in ("ollama", "comfyui", "desktop"):
        await page.wait_for_selector(f'.card[data-tenant="{name}"]', timeout=WAIT_MS)
    await page.wait_for_selector('#health-badge[data-status="ok"]', timeout=WAIT_MS)
    sub = page.locator('.card[data-tenant="ollama"] [data-role="engine"]')
    await sub.filter(has_text="0.12.3").wait_for(timeout=WAIT_MS)  # from GET /api/engines
    assert "OLLAMA_NUM_PARALLEL" in (await sub.get_attribute("title") or ""), "full settings list belongs in the tooltip"
    assert await page.is_hidden("#health"), "health details stay collapsed while every check is ok"
    assert await page.is_disabled('.card[data-tenant="desktop"] button'), "the desktop has no release strategy"
    assert not console.errors, console.errors


async def test_each_test_gets_a_browser_context_with_nothing_stored(browser: BrowserContext) -> None:
    # One Chromium serves the worker's tests: only a fresh context per test keeps one test's token
    # (localStorage) or cookies from reaching the next.
    assert await browser.storage_state() == {"cookies": [], "origins": []}
    assert not browser.pages


async def test_memory_bar_grows_when_the_ollama_simulator_loads_a_model(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    page, console = await dashboard(demo)
    await page.wait_for_selector('#membar [data-segment="ollama"]', state="attached", timeout=WAIT_MS)
    before = await segment_bytes(page, "ollama")
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                            json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
        assert r.status_code == 200, r.text
    await wait_segment_above(page, "ollama", before)
    assert await segment_bytes(page, "free") < demo.box.gpu.read().device.total_bytes
    assert not console.errors, console.errors


async def test_release_button_frees_an_idle_comfyui_and_shows_the_measured_result(box: DemoFactory, dashboard: OpenDashboard,
                                                                                   artifacts: Path) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    page, console = await dashboard(demo)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        await run_prompt(demo.proxy.url("comfyui"), "flux1-dev-fp8.safetensors", http)
    await wait_segment_above(page, "comfyui", 10 * 1024**3)
    dialogs: list[str] = []

    async def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.accept()

    page.on("dialog", accept)
    await page.click('.card[data-tenant="comfyui"] button[data-release="comfyui"]')
    result = page.locator('.card[data-tenant="comfyui"] [data-role="result"]')
    await result.filter(has_text="freed").wait_for(timeout=WAIT_MS)
    text = await result.inner_text()
    assert dialogs and "comfyui" in dialogs[0], "a release is confirmed first"
    assert " GiB in " in text and float(text.split("freed ")[1].split(" GiB")[0]) > 10, text
    await page.locator('#decisions li[data-kind="release"]').filter(has_text="freed").wait_for(timeout=WAIT_MS)
    await page.wait_for_function(
        "() => Number(document.querySelector('#membar [data-segment=\"comfyui\"]').dataset.bytes) < 2 * 1024 ** 3",
        timeout=WAIT_MS)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:  # something on the card for the screenshot
        await http.post(demo.box.servers["ollama"].url + "/api/generate",
                        json={"model": "llama3.1:8b", "prompt": "hi", "stream": False})
    await wait_segment_above(page, "ollama", 4 * 1024**3)
    await page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
    assert not console.errors, console.errors


async def test_a_failing_health_check_expands_with_its_fix(box: DemoFactory, browser: BrowserContext,
                                                         dashboard: OpenDashboard, app_timers: dict[str, int],
                                                         artifacts: Path) -> None:
    demo = await box("default")
    await browser.clock.install()
    page, _ = await dashboard(demo)
    await page.wait_for_selector('#health-badge[data-status="ok"]', timeout=WAIT_MS)
    await ollama_of(demo).stop()
    await page.clock.fast_forward(app_timers["HEALTH_POLL_MS"])  # the page's next health poll, now
    entry = page.locator('#health [data-check="upstream ollama"]')
    await entry.wait_for(state="visible", timeout=WAIT_MS)
    assert await page.get_attribute("#health-badge", "data-status") in ("failed", "degraded")
    assert await entry.locator(".fix code").inner_text(), "a broken check shows its fix"
    # The jump also aged the last stream frame past the stale mark; the next frame clears it.
    await page.wait_for_selector("#stale", state="hidden", timeout=WAIT_MS)
    await page.screenshot(path=str(artifacts / "dashboard-health.png"), full_page=True)


async def test_stale_marker_shows_while_the_stream_is_down_and_clears_when_it_reconnects(
        box: DemoFactory, browser: BrowserContext, app_timers: dict[str, int]) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    await browser.clock.install()
    page = browser.pages[0] if browser.pages else await browser.new_page()
    # The stream is down from the start: each attempt ends at once with no frame, and asks for a quick retry.
    await page.route("**/api/events", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body="retry: 300\n\n"))
    await page.goto(demo.proxy.url("admin") + "/")
    await page.clock.fast_forward(app_timers["STALE_AFTER_MS"] + 500)  # that long without a frame, without waiting it out
    await page.wait_for_selector("#stale", state="visible", timeout=WAIT_MS)
    await page.unroute("**/api/events")  # EventSource retries by itself
    await page.wait_for_selector('.card[data-tenant="ollama"]', timeout=WAIT_MS)
    await page.wait_for_selector("#stale", state="hidden", timeout=WAIT_MS)


async def test_release_sends_the_token_from_the_token_field_and_shows_a_refusal_without_it(
        box: DemoFactory, dashboard: OpenDashboard, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "s3cret-for-the-test")
    demo = await box("default")
    page, _ = await dashboard(demo)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                            json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
        assert r.status_code == 200, r.text
    await wait_segment_above(page, "ollama", 0)
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    result = page.locator('.card[data-tenant="ollama"] [data-role="result"]')
    await page.click('button[data-release="ollama"]')
    await result.filter(has_text="401").wait_for(timeout=WAIT_MS)
    await page.fill("#token", "s3cret-for-the-test")
    await page.dispatch_event("#token", "change")
    assert await page.evaluate("localStorage.getItem('hyperswap.token')") == "s3cret-for-the-test"
    await page.click('button[data-release="ollama"]')
    await result.filter(has_text="freed").wait_for(timeout=WAIT_MS)


async def test_dashboard_files_are_served_with_their_types_and_an_unknown_one_is_a_404(box: DemoFactory) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    base = demo.proxy.url("admin")
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        page = await http.get(base + "/")
        js = await http.get(base + "/static/app.js")
        css = await http.get(base + "/static/app.css")
        missing = await http.get(base + "/static/nope.js")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"], "no inline or third-party scripts"
    assert js.headers["content-type"].startswith("text/javascript") and "EventSource" in js.text
    assert css.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and "fix" in missing.json()
    assert "http" not in page.text.replace('xmlns="http://www.w3.org/2000/svg"', ""), "no CDN: every asset is same-origin"


async def test_decision_log_shows_a_507_with_its_blockers_and_an_oom_retry(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    page, console = await dashboard(demo)
    await page.wait_for_selector('.card[data-tenant="ollama"]', timeout=WAIT_MS)
    gib = 1024**3
    blocker = Blocker(4321, "stt_relay.py", "unmanaged", 6 * gib, "unmanaged", "not a tenant")
    plan = Plan("ollama", 20 * gib, 3 * gib, 0, False, True, (), (blocker,), "not enough even after releases", False,
                possible=False)
    decisions = demo.proxy.decisions  # the path the SSE frame takes
    decisions.emit(Rejected(tenant="ollama", trigger="POST /api/generate", plan=plan, status=507, reason="too big"))
    decisions.emit(OomRetry(tenant="comfyui", trigger="OOM answer", result="retried after releasing ollama"))
    rejection = page.locator('#decisions li[data-kind="rejection"]')
    await rejection.filter(has_text="stt_relay.py").wait_for(timeout=WAIT_MS)
    text = await rejection.inner_text()
    assert "507" in text and "stt_relay.py (unmanaged, 6 GiB)" in text and "needs 20 GiB" in text, text
    retried = page.locator('#decisions li[data-kind="oom_retry"]').filter(has_text="retried after releasing")
    await retried.wait_for(timeout=WAIT_MS)
    assert not console.errors, console.errors


async def test_timeline_of_a_freshly_opened_page_starts_with_the_recorded_minutes(
        box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    telemetry = next(e for e in demo.proxy.extensions if isinstance(e, Telemetry))
    assert telemetry.store is not None, "the test box records telemetry (HOME is a temp dir)"
    now = time.time()
    # Three windows recorded before the page opened: ComfyUI held 6 GiB, then 2 GiB.
    for ago, held in ((180, 6 * GIB), (120, 6 * GIB), (60, 2 * GIB)):
        telemetry.store.submit("vram", {"at": now - ago, "tenant": "comfyui", "window_s": 10.0, "samples": 10,
                                        "min_bytes": held, "max_bytes": held, "last_bytes": held})
    assert telemetry.store.flush()
    page, console = await dashboard(demo)
    await page.locator("#timeline-start").filter(has_text="\N{MINUS SIGN}3 min").wait_for(timeout=WAIT_MS)
    line = page.locator('#timeline polyline[data-tenant="comfyui"]')
    await line.wait_for(state="attached", timeout=WAIT_MS)
    heights = {float(p.split(",")[1]) for p in (await line.get_attribute("points") or "").split()}
    assert len(heights) >= 2, "the recorded 6 GiB and 2 GiB must both be drawn, not only the live value"
    assert not console.errors, console.errors


class HeldClock:
    """A simulator's clock whose sleeps wait for the test's go: a render that lasts until the test has
    seen what it looks for, however loaded the machine, and not a step longer. Its first `free`
    sleeps pass (a load held part of the way onto the card)."""

    def __init__(self, inner: Clock, free: int = 0) -> None:
        self.inner = inner
        self.free = free
        self.go = asyncio.Event()

    def now(self) -> float:
        return self.inner.now()

    def wall(self) -> float:
        return self.inner.wall()

    async def sleep(self, seconds: float) -> None:
        if self.free > 0:
            self.free -= 1
        else:
            await self.go.wait()
        await self.inner.sleep(seconds)


async def test_a_chat_waiting_for_a_render_shows_on_its_card_until_it_runs(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    assert demo.proxy is not None and demo.box.comfyui is not None
    page, console = await dashboard(demo)
    base = demo.proxy.url("comfyui")
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        await run_prompt(base, "flux1-dev-fp8.safetensors", http)  # the checkpoint is loaded: the next render only samples
        held = HeldClock(demo.box.comfyui.clock)
        demo.box.comfyui.clock = held  # its sampling steps wait for held.go
        cid = uuid.uuid4().hex
        prompt = comfy_prompt("flux1-dev-fp8.safetensors")
        # max_queue=None: the socket reads every frame as it comes; with a full receive queue it stops
        # reading, never sees the server's close frame and waits out its 10 s close timeout.
        async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}", max_queue=None) as ws:
            await ws.recv()
            assert (await http.post(base + "/prompt", json={"prompt": prompt, "client_id": cid})).status_code == 200
            await poll_until(lambda: proxy_of(demo).inflight.traffic("comfyui").jobs, 0.01)
            chat = asyncio.ensure_future(http.post(demo.proxy.url("ollama") + "/api/generate",
                                                   json={"model": "gemma3:27b", "prompt": "hi", "stream": False}))
            waiting = page.locator('.card[data-tenant="ollama"] [data-role="waiting"]')
            await waiting.filter(has_text="queued behind comfyui").wait_for(timeout=WAIT_MS)
            assert "waiting for memory" in (await page.text_content("#device") or "")
            assert not chat.done(), "the chat waits while the render holds the card"
            held.go.set()  # the render runs to its end
            assert (await chat).status_code == 200, "answered once the render ended"
    await page.wait_for_selector('.card[data-tenant="ollama"][data-waiting="0"]', timeout=WAIT_MS)
    assert not console.errors, console.errors


async def test_comfyui_subtitle_names_its_start_flags(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box(fast("default", comfyui={"argv": ["main.py", "--highvram", "--reserve-vram", "1.5"]}))
    page, console = await dashboard(demo)
    sub = page.locator('.card[data-tenant="comfyui"] [data-role="engine"]')
    await sub.filter(has_text="0.8.0").wait_for(timeout=WAIT_MS)  # from GET /api/engines
    text = await sub.inner_text()
    assert "[object Object]" not in text and "--highvram --reserve-vram 1.5" in text, text
    assert "--highvram: " in (await sub.get_attribute("title") or ""), "each flag's meaning belongs in the tooltip"
    assert not console.errors, console.errors


def accept_dialogs(page: Page) -> None:
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))


async def test_a_release_that_freed_nothing_is_not_shown_as_released(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    page, console = await dashboard(demo)
    await page.wait_for_selector('.card[data-tenant="comfyui"]', timeout=WAIT_MS)
    accept_dialogs(page)
    await page.click('button[data-release="comfyui"]')  # ComfyUI idles at its floor: nothing above it to free
    result = page.locator('.card[data-tenant="comfyui"] [data-role="result"]')
    await result.filter(has_text="freed nothing").wait_for(timeout=WAIT_MS)
    assert await result.get_attribute("data-result") == "none", "no green for a release that freed nothing"
    badge = page.locator('#decisions li[data-kind="release"] .kind')
    await badge.filter(has_text="freed nothing").wait_for(timeout=WAIT_MS)
    assert await badge.get_attribute("data-result") == "nothing"
    assert not console.errors, console.errors


async def test_a_release_judged_on_the_engines_report_shows_as_estimated(box: DemoFactory,
                                                                          dashboard: OpenDashboard) -> None:
    demo = await box("default")
    page, console = await dashboard(demo)
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                            json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
        assert r.status_code == 200, r.text
    await wait_segment_above(page, "ollama", 0)
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    accept_dialogs(page)
    await page.click('button[data-release="ollama"]')
    result = page.locator('.card[data-tenant="ollama"] [data-role="result"]')
    await result.filter(has_text="estimated").wait_for(timeout=WAIT_MS)
    assert await result.get_attribute("data-result") == "warn", await result.inner_text()
    badge = page.locator('#decisions li[data-kind="release"] .kind')
    await badge.filter(has_text="estimated").wait_for(timeout=WAIT_MS)
    assert await badge.get_attribute("data-result") == "estimated"
    assert not console.errors, console.errors


async def test_gpu_panel_shows_the_cards_settings_and_the_profiles_drift(box: DemoFactory, dashboard: OpenDashboard,
                                                                          artifacts: Path) -> None:
    demo = await box("gpu-drift")
    page, console = await dashboard(demo)
    drift = page.locator('#gpu-settings [data-setting="power_limit_w"][data-status="drift"]')
    await drift.wait_for(timeout=WAIT_MS)
    assert "450 W" in await drift.inner_text() and "300 W" in await drift.inner_text()
    panel = await page.locator("#gpu-settings").inner_text()
    assert "Simulated RTX 4090" in panel and "150\u2013600 W" in panel and "63 °C" in panel
    assert "profile compared (apply off)" in panel
    # application clocks: unknown on this card, shown as a dash with the reason on hover, never as 0
    assert "not supported" in (await page.locator("#gpu-settings dd [title]").first.get_attribute("title") or "")
    logged = page.locator('#decisions [data-kind="gpu_drift"]').filter(has_text="GPU 0: power limit is 450 W")
    await logged.wait_for(timeout=WAIT_MS)
    await page.screenshot(path=str(artifacts / "dashboard-gpu.png"), full_page=True)
    assert not console.errors, console.errors


async def test_two_gpus_show_one_line_per_card_with_what_each_tenant_holds_there(box: DemoFactory,
                                                                                  dashboard: OpenDashboard) -> None:
    demo = await box("two-gpus")
    page, console = await dashboard(demo)
    await page.wait_for_selector('#devices li[data-device="1"]', timeout=WAIT_MS)
    card1 = page.locator('#devices li[data-device="1"]')
    await card1.filter(has_text="comfyui").wait_for(timeout=WAIT_MS)
    assert "Simulated RTX 4080" in await card1.inner_text()
    assert "ollama" not in await page.locator('#devices li[data-device="1"]').inner_text()
    assert "placed here: ollama" in await page.locator('#devices li[data-device="0"]').inner_text()
    assert not console.errors, console.errors


async def test_one_gpu_shows_no_per_card_lines(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    page, console = await dashboard(demo)
    await page.wait_for_selector('#membar [data-segment="free"]', state="attached", timeout=WAIT_MS)
    assert await page.is_hidden("#devices")
    assert not console.errors, console.errors
