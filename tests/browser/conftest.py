"""Fixtures: the demo box on port 0 with fast delays, and Debian's Chromium driven by Playwright.

Chromium must launch: a machine without it fails these tests (install `chromium`; never a downloaded browser)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
from playwright.async_api import BrowserContext, Page, async_playwright

from proxy.demo import Demo, start_demo
from proxy.sim.box import Scenario, load_scenario

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}

DemoFactory = Callable[..., Awaitable[Demo]]


def fast(name: str) -> Scenario:
    """A shipped scenario with delays cut to milliseconds (as the integration tests do)."""
    data = load_scenario(name).model_dump()
    data["ollama"].update({"load_gbps": 200.0, "unload_delay_s": 0.15, "token_rate": 2000.0})
    data["comfyui"].update({"free_delay_s": 0.15, "load_gbps": 200.0, "step_time_s": 0.002})
    return Scenario.model_validate(data)


@pytest.fixture
async def box() -> AsyncIterator[DemoFactory]:
    started: list[Demo] = []

    async def make(scenario: str = "default", **kw: Any) -> Demo:
        demo = await start_demo(fast(scenario), sim_ports={"ollama": 0, "comfyui": 0}, proxy_ports=PORTS_ZERO,
                                watchdog=kw.pop("watchdog", False), **kw)
        started.append(demo)
        return demo

    yield make
    for demo in started:
        await demo.stop()


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    """A fresh Chromium profile per test; a launch failure is an error, never a skip."""
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            await context.close()


class Console:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", lambda msg: self.errors.append(f"console: {msg.text} ({msg.location.get('url')})") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))


OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Console]]]


@pytest.fixture
def dashboard(browser: BrowserContext) -> OpenDashboard:
    """Open the demo's dashboard in the browser: (page, its console errors)."""

    async def open_(demo: Demo) -> tuple[Page, Console]:
        page = browser.pages[0] if browser.pages else await browser.new_page()
        console = Console(page)
        assert demo.proxy is not None
        await page.goto(demo.proxy.url("admin") + "/")
        return page, console

    return open_


@pytest.fixture
def artifacts() -> Path:
    """tests/artifacts/ (gitignored): screenshots for a human to look at."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
