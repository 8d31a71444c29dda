"""The memory side of the engines, asked by tenant: a thin layer over each tenant's adapter
(`proxy.engines.registry`), kept for callers that hold a tenant rather than an adapter.

Every rule lives in the adapters (`ollama.py`, `comfyui.py`, `base.py` for the generic default);
the release call itself is chosen by the tenant's `release.kind` (`common.release_by_strategy`).
"""

from __future__ import annotations

from typing import Any

import httpx

from proxy.config.schema import Tenant
from proxy.engines.comfyui import COMFY_OOM_TYPES, comfy_event_is_oom
from proxy.engines.common import Need, ReleaseFailed, go_time
from proxy.engines.ollama import OLLAMA_OOM_MARKERS, OllamaCatalog, ollama_error_is_oom
from proxy.engines.ports import Placement
from proxy.engines.registry import adapter_for
from proxy.gpu.snapshot import DeviceMemory

__all__ = [
    "COMFY_OOM_TYPES",
    "OLLAMA_OOM_MARKERS",
    "Need",
    "OllamaCatalog",
    "ReleaseFailed",
    "comfy_device",
    "comfy_event_is_oom",
    "comfy_running_prompts",
    "go_time",
    "load_key",
    "ollama_error_is_oom",
    "ollama_ps",
    "placements",
    "release",
    "response_is_oom",
    "runs_on_cpu",
    "self_reported_bytes",
]


def load_key(tenant: Tenant, model: str) -> str:
    return adapter_for(tenant).load_key(model)


def response_is_oom(tenant: Tenant, status: int, body: bytes) -> bool:
    return adapter_for(tenant).response_is_oom(status, body)


async def release(tenant: Tenant, client: httpx.AsyncClient) -> dict[str, Any]:
    return await adapter_for(tenant).release(client)


async def placements(tenant: Tenant, client: httpx.AsyncClient) -> list[Placement]:
    return await adapter_for(tenant).placements(client)


async def ollama_ps(tenant: Tenant, client: httpx.AsyncClient) -> list[Placement]:
    """Ollama's loaded models (`/api/ps`): the tenant's placements."""
    return await placements(tenant, client)


async def comfy_running_prompts(tenant: Tenant, client: httpx.AsyncClient) -> list[str]:
    """The prompt ids ComfyUI's /queue says run now: the tenant's running jobs."""
    return await adapter_for(tenant).running_jobs(client)


async def runs_on_cpu(tenant: Tenant, client: httpx.AsyncClient) -> bool:
    return await adapter_for(tenant).runs_on_cpu(client)


async def comfy_device(tenant: Tenant, client: httpx.AsyncClient) -> DeviceMemory | None:
    """The card as the tenant's engine reports it (ComfyUI's /system_stats); None when it does not."""
    return await adapter_for(tenant).device_report(client)


async def self_reported_bytes(tenant: Tenant, client: httpx.AsyncClient) -> int | None:
    return await adapter_for(tenant).self_reported_bytes(client)
