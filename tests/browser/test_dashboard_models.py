"""The dashboard's model files table: residency per model, and warming one from the page."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from playwright.async_api import Page

from proxy.demo import Demo

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]
WAIT_MS = 10_000


async def test_the_models_table_shows_residency_and_warms_a_model_on_click(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    assert demo.box.files is not None
    cold = demo.box.files.drop_all()
    page, console = await dashboard(demo)
    row = page.locator('#models tr[data-model="ollama:llama3.1:8b"]')
    await row.wait_for(timeout=WAIT_MS)
    assert "4.9" in (await row.inner_text())
    if cold:
        assert "0 %" in (await row.locator("td").nth(3).inner_text())
    await row.locator("button").click()
    await page.wait_for_function(
        "() => { const r = document.querySelector('#models tr[data-model=\"ollama:llama3.1:8b\"]');"
        " return r && r.cells[3].textContent.trim() === '100 %' && r.cells[4].textContent.startsWith('done'); }",
        timeout=WAIT_MS)
    assert not console.errors, console.errors
