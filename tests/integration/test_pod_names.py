"""The admin API and the event stream name the Kubernetes pod of a GPU process (when the reader knows it)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import httpx

from proxy.gpu.snapshot import GpuReader, GpuSnapshot, PodRef
from tests.integration.boxes import DemoFactory, proxy_of


class WithPods:
    """The simulated GPU's snapshots, with a pod for every process named `python` (ComfyUI's simulator)."""

    def __init__(self, inner: GpuReader) -> None:
        self.inner = inner

    def read(self) -> GpuSnapshot:
        snap = self.inner.read()
        pods = {p.pid: PodRef("images", "comfyui-0", "comfyui", MappingProxyType({"app": "comfyui"}))
                for p in snap.processes}
        return replace(snap, pods=MappingProxyType(pods))


async def test_stats_and_tenant_views_name_the_pod(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    broker = proxy_of(demo).broker
    broker.reader = WithPods(broker.reader)
    await broker.snapshot()
    admin = proxy_of(demo).url("admin")
    stats = (await http.get(admin + "/api/stats")).json()
    assert stats["processes"], "the default scenario has GPU processes"
    assert all(p["pod"] == {"namespace": "images", "name": "comfyui-0", "container": "comfyui"} for p in stats["processes"])
    tenants = (await http.get(admin + "/api/tenants")).json()["tenants"]
    named = [p["pod"] for t in tenants for p in t["processes"]]
    assert named and all(p["name"] == "comfyui-0" for p in named)


async def test_without_kubernetes_the_pod_is_null(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    stats = (await http.get(proxy_of(demo).url("admin") + "/api/stats")).json()
    assert stats["processes"] and all(p["pod"] is None for p in stats["processes"])
