"""The dashboard's start and stop buttons for a tenant the proxy starts and stops: a real `process`
child (Python's own HTTP server) on the simulated box, driven from Chromium."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from playwright.async_api import Dialog, Page

from proxy.demo import Demo
from proxy.sim.box import fast_scenario as fast
from tests.integration.boxes import free_port, port_open, process_tenant

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]

WAIT_MS = 15_000


async def test_start_and_stop_buttons_run_and_stop_a_process_tenant(box: DemoFactory, dashboard: OpenDashboard,
                                                                     tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    page, console = await dashboard(demo)
    card = '.card[data-tenant="app"]'
    state = page.locator(f'{card} [data-role="lifecycle"]')
    await state.filter(has_text="stopped").wait_for(timeout=WAIT_MS)
    assert await page.is_disabled(f'{card} button[data-stop="app"]'), "a stopped app cannot be stopped"
    assert await page.locator('.card[data-tenant="ollama"] button[data-start]').count() == 0, \
        "a tenant the proxy does not start has no start button"

    await page.click(f'{card} button[data-start="app"]')
    await page.locator(f'{card} [data-role="result"]').filter(has_text="started").wait_for(timeout=WAIT_MS)
    await state.filter(has_text="running").wait_for(timeout=WAIT_MS)
    assert port_open(port), "the app answers once the dashboard says running"
    assert await page.is_disabled(f'{card} button[data-start="app"]')

    dialogs: list[str] = []

    async def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.accept()

    page.on("dialog", accept)
    await page.click(f'{card} button[data-stop="app"]')
    await page.locator(f'{card} [data-role="result"]').filter(has_text="stopped").wait_for(timeout=WAIT_MS)
    await state.filter(has_text="stopped").wait_for(timeout=WAIT_MS)
    assert dialogs and "app" in dialogs[0], "a stop is confirmed first"
    assert not port_open(port), "the app's port still answers after the stop"
    assert await page.is_enabled(f'{card} button[data-start="app"]')
    await page.screenshot(path=str(artifacts / "dashboard-lifecycle.png"), full_page=True)
    assert not console.errors, console.errors


async def test_the_start_button_needs_the_token_when_one_is_set(box: DemoFactory, dashboard: OpenDashboard,
                                                                tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "dash-token")
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    page, console = await dashboard(demo)
    card = '.card[data-tenant="app"]'
    await page.click(f'{card} button[data-start="app"]')
    await page.locator(f'{card} [data-role="result"]').filter(has_text="401").wait_for(timeout=WAIT_MS)
    assert not port_open(port)
    await page.fill("#token", "dash-token")
    await page.dispatch_event("#token", "change")
    await page.click(f'{card} button[data-start="app"]')
    await page.locator(f'{card} [data-role="lifecycle"]').filter(has_text="running").wait_for(timeout=WAIT_MS)
    assert port_open(port)
    assert [e for e in console.errors if "401" not in e] == [], console.errors
