"""On Kubernetes the dashboard names the pod of each tenant's GPU processes (Chromium against the simulated box)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from playwright.async_api import Page

from proxy.demo import Demo
from proxy.gpu.snapshot import GpuSnapshot, PodRef
from tests.integration.boxes import proxy_of

DemoFactory = Callable[..., Awaitable[Demo]]
OpenDashboard = Callable[[Demo], Awaitable[tuple[Page, Any]]]


class WithPods:
    """The simulated GPU's snapshots, each process in a pod named after its pid."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def read(self) -> GpuSnapshot:
        snap: GpuSnapshot = self.inner.read()
        pods = {p.pid: PodRef("ai", f"engine-{p.pid}", "main", MappingProxyType({})) for p in snap.processes}
        return replace(snap, pods=MappingProxyType(pods))


async def test_tenant_cards_name_their_pods(box: DemoFactory, dashboard: OpenDashboard) -> None:
    demo = await box("default")
    broker = proxy_of(demo).broker
    broker.reader = WithPods(broker.reader)
    snap = await broker.snapshot()
    owners = {p.tenant: p.process.pid for p in snap.processes if p.tenant != "unmanaged"}
    assert owners, "the default scenario starts with GPU processes of some tenant"
    page, console = await dashboard(demo)
    for tenant, pid in owners.items():
        pods = page.locator(f'.card[data-tenant="{tenant}"] [data-role="pods"]')
        await pods.filter(has_text=f"ai/engine-{pid}").wait_for(timeout=10_000)
    assert not console.errors, console.errors
