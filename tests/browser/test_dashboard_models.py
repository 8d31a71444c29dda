"""The dashboard's model files table: residency per model, and warming one from the page."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from playwright.async_api import BrowserContext, Page

from proxy.demo import Demo
from proxy.tasks import poll_until

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]
WAIT_MS = 10_000


async def model_row(admin: str, key: str) -> dict[str, Any]:
    """One model as GET /api/models reports it."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        body = (await http.get(admin + "/api/models")).json()
    return next(m for t in body["tenants"] for m in t["models"] if m["key"] == key)


async def test_the_models_table_shows_residency_and_warms_a_model_on_click(box: DemoFactory, browser: BrowserContext,
                                                                           dashboard: OpenDashboard,
                                                                           app_timers: dict[str, int]) -> None:
    demo = await box("default")
    assert demo.box.files is not None and demo.proxy is not None
    cold = demo.box.files.drop_all()
    await browser.clock.install()
    page, console = await dashboard(demo)
    row = page.locator('#models tr[data-model="ollama:llama3.1:8b"]')
    await row.wait_for(timeout=WAIT_MS)
    assert "4.9" in (await row.inner_text())
    if cold:
        assert "0 %" in (await row.locator("td").nth(3).inner_text())
    await row.locator("button").click()
    admin, key = demo.proxy.url("admin"), "ollama:llama3.1:8b"

    async def warmed() -> bool:
        listed = await model_row(admin, key)
        return bool(listed["warm"] and listed["warm"]["state"] == "done" and listed["residency"]["resident_percent"] == 100)

    # The proxy has read the files and says so. (A listing measured while the warm ran can keep the old
    # residency cached up to its TTL after the warm ends: the page's next poll would still show 0 %.)
    async with asyncio.timeout(2 * WAIT_MS / 1000):
        await poll_until(warmed, 0.1)
    await page.clock.fast_forward(app_timers["MODELS_POLL_MS"])  # the page's next poll, now: it shows the same
    await page.wait_for_function(
        "() => { const r = document.querySelector('#models tr[data-model=\"ollama:llama3.1:8b\"]');"
        " return r && r.cells[3].textContent.trim() === '100 %' && r.cells[4].textContent.startsWith('done'); }",
        timeout=WAIT_MS)
    assert not console.errors, console.errors
