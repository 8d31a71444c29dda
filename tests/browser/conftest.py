"""Fixtures: the demo box on port 0 with fast delays, and Debian's Chromium driven by Playwright.

Chromium must launch: a machine without it fails these tests (install `chromium`; never a downloaded browser)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, Page, async_playwright

from proxy.demo import Demo

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

DemoFactory = Callable[..., Awaitable[Demo]]


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
        page.on("console", lambda msg: self.errors.append(f"console: {msg.text} ({msg.location.get('url')})")
                if msg.type == "error" else None)
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
