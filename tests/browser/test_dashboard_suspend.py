"""The dashboard shows what a tenant with a cuda_suspend step has parked in host RAM (issue 43)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from playwright.async_api import Page

from proxy.demo import Demo
from proxy.sim.box import fast_scenario as fast
from tests.integration.boxes import chat, render, succeeded

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]

WAIT_MS = 15_000


async def test_a_suspended_tenants_card_shows_its_memory_parked_in_host_ram(box: DemoFactory,
                                                                           dashboard: OpenDashboard) -> None:
    demo = await box(fast("suspend"))
    page, console = await dashboard(demo)
    assert succeeded(await render(demo, "sd_xl_base_1.0.safetensors"))
    assert (await chat(demo, "qwen2.5:14b")).message.content  # ComfyUI is suspended for it
    row = page.locator('.card[data-tenant="comfyui"] [data-role="suspension"]')
    await row.filter(has_text="suspended").wait_for(timeout=WAIT_MS)
    assert "GiB parked" in await row.inner_text()
    assert await page.locator('.card[data-tenant="ollama"] [data-role="suspension"]').count() == 0, \
        "a tenant that runs shows no host RAM row"
    assert not console.errors, console.errors
