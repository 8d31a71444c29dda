"""Fixtures: the demo box on port 0 with fast delays, and Debian's Chromium driven by Playwright.

Chromium must launch: a machine without it fails these tests (install `chromium`; never a downloaded browser).

One Chromium per worker, started by the first test that needs it, and a fresh browser context for every
test: its own cookies, storage and cache, as the fresh profile per test gave, without paying a Chromium
start (2-4 s on two loaded cores) each time. Playwright's objects belong to the event loop they were
made on, so every test here, and its demo box, runs on the worker's shared loop (loop_scope "session")."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Browser, BrowserContext, Page, Playwright, ViewportSize, async_playwright

import proxy.admin.dashboard
from proxy.demo import Demo

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT: ViewportSize = {"width": 1280, "height": 900}
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
HERE = Path(__file__).resolve().parent
APP_JS = Path(proxy.admin.dashboard.__file__).resolve().parent / "static" / "app.js"

DemoFactory = Callable[..., Awaitable[Demo]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every async test in this folder runs on the worker's shared loop, where its Chromium lives."""
    on_shared_loop = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        if HERE in Path(item.path).parents and pytest_asyncio.is_async_test(item):
            item.add_marker(on_shared_loop, append=False)


class Chromium:
    """Playwright and one Chromium for this worker, launched again if it died (one crash fails one test)."""

    def __init__(self, pw: Playwright, env: dict[str, str]) -> None:
        self.pw = pw
        self.env = env
        self.browser: Browser | None = None

    async def launch(self) -> Browser:
        if self.browser is None or not self.browser.is_connected():
            self.browser = await self.pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                                                         env={**self.env})
        return self.browser


def chromium_env(home: Path) -> dict[str, str]:
    """What the browser and its driver see: a temporary HOME (as _isolated_home gives each test; this
    process outlives the test that started it) and no proxy from the environment: loopback only."""
    proxies = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"}
    env = {k: v for k, v in os.environ.items() if k not in proxies and not k.startswith("HYPERSWAP_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               NO_PROXY="127.0.0.1,localhost")
    return env


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def chromium(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Chromium]:
    """Launched here, not skipped: a launch failure is an error in every test that needs it."""
    env = chromium_env(tmp_path_factory.mktemp("chromium-home"))
    with pytest.MonkeyPatch.context() as mp:  # the Playwright driver is a child process too
        for key in set(os.environ) - set(env):
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        pw = await async_playwright().start()
    chromium = Chromium(pw, env)
    try:
        await chromium.launch()
        yield chromium
    finally:
        if chromium.browser is not None:
            await chromium.browser.close()
        await pw.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def browser(chromium: Chromium) -> AsyncIterator[BrowserContext]:
    """A fresh, isolated browser context per test (no cookies, storage or cache from another test)."""
    context = await (await chromium.launch()).new_context(viewport=VIEWPORT)
    try:
        yield context
    finally:
        await context.close()


@pytest.fixture
def box(box_on_the_session_loop: DemoFactory) -> DemoFactory:
    """tests/conftest.py's `box`, on the shared loop the page and Playwright use; still stopped after each test."""
    return box_on_the_session_loop


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
def app_timers() -> dict[str, int]:
    """app.js's timer periods (`const HEALTH_POLL_MS = 3000;`): a test that installs Playwright's clock
    before opening the page moves it on by one of these to fire that poll now instead of waiting it out."""
    timers = {name: int(ms) for name, ms in re.findall(r"const (\w+_MS) = (\d+);", APP_JS.read_text())}
    assert {"STALE_AFTER_MS", "HEALTH_POLL_MS", "MODELS_POLL_MS"} <= set(timers), timers
    return timers


@pytest.fixture
def artifacts() -> Path:
    """tests/artifacts/ (gitignored): screenshots for a human to look at."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS

