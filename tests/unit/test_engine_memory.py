"""What ComfyUI's /system_stats says about memory (wire facts B.5), read through a mock transport."""

from __future__ import annotations

from typing import Any

import httpx

from proxy.engines import memory
from proxy.tenants import GIB, Tenant, registry_from_dict

HOST_RAM = int(24.04 * GIB)


def stats(device: dict[str, Any]) -> dict[str, Any]:
    return {"system": {"comfyui_version": "0.8.0", "argv": ["main.py"]}, "devices": [device]}


CPU = stats({"name": "cpu", "type": "cpu", "index": None, "vram_total": int(23.54 * GIB), "vram_free": 20 * GIB,
             "torch_vram_total": HOST_RAM, "torch_vram_free": 20 * GIB})
CUDA = stats({"name": "cuda:0 NVIDIA GeForce RTX 4090 : cudaMallocAsync", "type": "cuda", "index": 0,
              "vram_total": 24 * GIB, "vram_free": 18 * GIB, "torch_vram_total": 5 * GIB, "torch_vram_free": GIB})


def comfyui() -> Tenant:
    return registry_from_dict({"tenants": {"comfyui": {"upstream": "http://127.0.0.1:28188"}}}).get("comfyui")


def client(payload: dict[str, Any]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/system_stats", request.url
        return httpx.Response(200, json=payload)

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


async def test_a_cpu_comfyui_holds_no_vram_and_reports_no_card() -> None:
    tenant = comfyui()
    async with client(CPU) as c:
        assert await memory.self_reported_bytes(tenant, c) == 0, "torch_vram_total is host RAM on the CPU"
        assert await memory.comfy_device(tenant, c) is None, "host RAM is not a card"
        assert await memory.runs_on_cpu(tenant, c) is True


async def test_a_cuda_comfyui_reports_its_card_and_what_torch_holds() -> None:
    tenant = comfyui()
    async with client(CUDA) as c:
        assert await memory.self_reported_bytes(tenant, c) == 5 * GIB + tenant.idle_vram_bytes
        device = await memory.comfy_device(tenant, c)
        assert device is not None and device.total_bytes == 24 * GIB and device.figure("free") == 18 * GIB
        assert device.figure("reserved") is None, "cudaMemGetInfo has no driver-reserved figure"
        assert await memory.runs_on_cpu(tenant, c) is False
