"""The memory side of each engine: how much a request needs, how to ask for memory back, how to
read an out-of-memory answer, and what the engine says about itself.

Selected by data: the tenant's `engine` kind picks need/OOM/self-report rules, its `release.kind`
picks the release call. The arbiter never sees any of this.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from proxy.gpu.snapshot import DeviceMemory
from proxy.tenants import GIB, Tenant

log = logging.getLogger("hyperswap.engines")

# Ollama's own classifier (llm/status.go IsOutOfMemory): case-insensitive substrings.
OLLAMA_OOM_MARKERS = ("out of memory", "out of device memory", "cudamalloc failed", "hipmalloc failed",
                      "failed to allocate", "allocation failed", "not enough memory", "insufficient memory",
                      "vk_error_out_of_device_memory", "unable to allocate cuda")
# ComfyUI classifies only torch's OOM exception as OOM (model_management.OOM_EXCEPTION).
COMFY_OOM_TYPES = ("torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError")


class ReleaseFailed(Exception):
    """The engine refused or could not be reached when asked for memory back."""


@dataclass(frozen=True, slots=True)
class Need:
    bytes: int
    what: str  # "llama3.1:8b (4.90 GiB + 1.00 GiB context allowance)"
    key: str  # identifies the load: concurrent requests with the same key share one reservation
    model: str | None = None  # the model or checkpoint it loads, when the request names one (model files)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None


def _base(tenant: Tenant) -> str:
    if not tenant.upstream:
        raise ReleaseFailed(f"tenant {tenant.name!r} has no upstream to call")
    return tenant.upstream


# -- need ---------------------------------------------------------------------------------------

class OllamaCatalog:
    """Installed model sizes from /api/tags, refreshed when a name is not found."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    @staticmethod
    def canonical(name: str) -> str:
        return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"

    async def size_of(self, tenant: Tenant, client: httpx.AsyncClient, model: str) -> int | None:
        key = self.canonical(model)
        if key not in self.sizes:
            await self.refresh(tenant, client)
        return self.sizes.get(key)

    async def refresh(self, tenant: Tenant, client: httpx.AsyncClient) -> None:
        r = await client.get(f"{_base(tenant)}/api/tags")
        r.raise_for_status()
        self.sizes = {m["name"]: int(m["size"]) for m in r.json().get("models") or []}


def load_key(tenant: Tenant, model: str) -> str:
    """Names one load: requests with the same key share one reservation, and residency is per key."""
    return f"{tenant.name}:{OllamaCatalog.canonical(model) if tenant.engine == 'ollama' else model}"


async def estimate_need(tenant: Tenant, path: str, body: bytes, client: httpx.AsyncClient,
                        catalog: OllamaCatalog) -> Need:
    """What the request needs in total on the card (the arbiter subtracts what the tenant already holds)."""
    data = _json(body)
    if tenant.engine == "ollama" and isinstance(data, dict) and isinstance(data.get("model"), str):
        model = OllamaCatalog.canonical(data["model"])
        key = load_key(tenant, model)
        override = tenant.model_vram_gb.get(model, tenant.model_vram_gb.get(data["model"]))
        if override is not None:
            return Need(int(override * GIB), f"{model} ({override:.2f} GiB, configured)", key, model)
        try:
            size = await catalog.size_of(tenant, client, model)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cannot read Ollama's model sizes: %s", exc)
            size = None
        if size is not None:
            total = size + tenant.context_allowance_bytes
            return Need(total, f"{model} ({size / GIB:.2f} GiB + {tenant.context_allowance_gb:.2f} GiB context allowance)",
                        key, model)
        return Need(tenant.needs_vram_bytes, f"{model} (size unknown: tenant need {tenant.needs_vram_gb:.2f} GiB)", key,
                    model)
    if tenant.engine == "comfyui" and isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        named: str | None = None
        for node in data["prompt"].values():
            ckpt = isinstance(node, dict) and (node.get("inputs") or {}).get("ckpt_name")
            if isinstance(ckpt, str) and ckpt in tenant.model_vram_gb:
                gb = tenant.model_vram_gb[ckpt]
                return Need(int(gb * GIB), f"{ckpt} ({gb:.2f} GiB, configured)", load_key(tenant, ckpt), ckpt)
            named = named or (ckpt if isinstance(ckpt, str) else None)
        return Need(tenant.needs_vram_bytes, f"{tenant.needs_vram_gb:.2f} GiB (needs_vram_gb)", tenant.name, named)
    return Need(tenant.needs_vram_bytes, f"{tenant.needs_vram_gb:.2f} GiB (needs_vram_gb)", tenant.name)


# -- out of memory ---------------------------------------------------------------------------------

def ollama_error_is_oom(message: str) -> bool:
    low = message.lower()
    return any(marker in low for marker in OLLAMA_OOM_MARKERS) and "system memory" not in low


def response_is_oom(tenant: Tenant, status: int, body: bytes) -> bool:
    """An engine's HTTP answer that says the GPU ran out of memory."""
    if tenant.engine != "ollama" or status < 400:
        return False
    data = _json(body)
    message = data.get("error") if isinstance(data, dict) else None
    if isinstance(message, dict):  # the /v1 error shape
        message = message.get("message")
    return isinstance(message, str) and ollama_error_is_oom(message)


def comfy_event_is_oom(event: Mapping[str, Any]) -> bool:
    return event.get("type") == "execution_error" and (event.get("data") or {}).get("exception_type") in COMFY_OOM_TYPES


# -- release ---------------------------------------------------------------------------------------

async def release(tenant: Tenant, client: httpx.AsyncClient) -> dict[str, Any]:
    """Ask the tenant for its memory back. Returns what was asked; the caller confirms on the GPU."""
    kind = tenant.release.kind
    try:
        if kind == "ollama_unload":
            r = await client.get(f"{_base(tenant)}/api/ps")
            r.raise_for_status()
            models = [m["name"] for m in r.json().get("models") or []]
            for name in models:
                u = await client.post(f"{_base(tenant)}/api/generate", json={"model": name, "keep_alive": 0})
                if u.status_code >= 400:
                    raise ReleaseFailed(f"Ollama refused to unload {name}: {u.status_code} {u.text[:200]}")
            return {"call": "keep_alive 0", "models": models}
        if kind == "comfyui_free":
            payload = {"unload_models": tenant.release.unload_models, "free_memory": tenant.release.free_memory}
            r = await client.post(f"{_base(tenant)}/free", json=payload)
            if r.status_code >= 400:
                raise ReleaseFailed(f"ComfyUI refused /free: {r.status_code}")
            return {"call": "POST /free", **payload}
        if kind == "http":
            url = tenant.release.url or ""
            if url.startswith("/"):
                url = _base(tenant) + url
            r = await client.request(tenant.release.method, url, json=tenant.release.body)
            if r.status_code >= 400:
                raise ReleaseFailed(f"release call {tenant.release.method} {url} answered {r.status_code}")
            return {"call": f"{tenant.release.method} {url}", "status": r.status_code}
    except httpx.HTTPError as exc:
        raise ReleaseFailed(f"cannot reach {tenant.name} at {tenant.upstream}: {exc}") from exc
    raise ReleaseFailed(tenant.not_reclaimable_reason)


# -- what the engine says about itself ---------------------------------------------------------------

async def ollama_ps(tenant: Tenant, client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Ollama's loaded models (`/api/ps`), each with `size`, `size_vram` and `expires_at`."""
    r = await client.get(f"{_base(tenant)}/api/ps")
    r.raise_for_status()
    return [m for m in r.json().get("models") or [] if isinstance(m, dict) and isinstance(m.get("name"), str)]


def go_time(value: object) -> float | None:
    """An RFC 3339 timestamp as Go writes it (nanoseconds, offset or Z) in Unix seconds; None if unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


async def comfy_running_prompts(tenant: Tenant, client: httpx.AsyncClient) -> list[str]:
    r = await client.get(f"{_base(tenant)}/queue")
    r.raise_for_status()
    return [item[1] for item in r.json().get("queue_running") or [] if isinstance(item, list) and len(item) > 1]


async def _comfy_torch_device(tenant: Tenant, client: httpx.AsyncClient) -> dict[str, Any] | None:
    """The first (torch) device of ComfyUI's /system_stats; None when unreadable."""
    try:
        r = await client.get(f"{_base(tenant)}/system_stats")
        dev = (r.json().get("devices") or [{}])[0]
    except (httpx.HTTPError, ValueError, TypeError, AttributeError, IndexError, ReleaseFailed):
        return None
    return dev if isinstance(dev, dict) else None


def _on_cpu(dev: Mapping[str, Any]) -> bool:
    """ComfyUI started with --cpu lists device type "cpu": its "vram" figures are host RAM."""
    return dev.get("type") == "cpu"


async def runs_on_cpu(tenant: Tenant, client: httpx.AsyncClient) -> bool:
    """The engine says it computes on the CPU, so it holds no GPU memory (ComfyUI --cpu)."""
    if tenant.engine != "comfyui" or not tenant.upstream:
        return False
    dev = await _comfy_torch_device(tenant, client)
    return dev is not None and _on_cpu(dev)


async def comfy_device(tenant: Tenant, client: httpx.AsyncClient) -> DeviceMemory | None:
    """ComfyUI's device-wide figures (cudaMemGetInfo), for when NVML is broken. None on the CPU:
    host RAM is not a card."""
    dev = await _comfy_torch_device(tenant, client)
    if dev is None or _on_cpu(dev):
        return None
    try:
        total, free = int(dev["vram_total"]), int(dev["vram_free"])
    except (KeyError, TypeError, ValueError):
        return None
    if total <= 0:
        return None
    # cudaMemGetInfo has no driver-reserved figure: that one stays unknown
    return DeviceMemory(int(dev.get("index") or 0), str(dev.get("name", "")), total, 0, total - free, free,
                        unknown=frozenset({"reserved"}))


async def self_reported_bytes(tenant: Tenant, client: httpx.AsyncClient) -> int | None:
    """The engine's own idea of its VRAM (used when NVML is broken; marked as an estimate)."""
    try:
        if tenant.engine == "ollama":
            r = await client.get(f"{_base(tenant)}/api/ps")
            return sum(int(m.get("size_vram", 0)) for m in r.json().get("models") or [])
        if tenant.engine == "comfyui":
            dev = await _comfy_torch_device(tenant, client)
            if dev is None:
                return None
            if _on_cpu(dev):
                return 0  # torch_vram_total is host RAM there: it holds no VRAM at all
            return int(dev.get("torch_vram_total", 0)) + tenant.idle_vram_bytes
    except (httpx.HTTPError, ValueError, ReleaseFailed, AttributeError, TypeError):
        return None
    return None
