"""Engine-neutral pieces every adapter shares: what a load needs, a failed release, the release
strategies chosen by `release.kind` in tenants.json, and small wire helpers.

Nothing here knows an engine by name; `proxy/engines/<kind>.py` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from proxy.config.fields import HttpCall
from proxy.config.release import ReleaseSpec
from proxy.config.schema import Tenant


class ReleaseFailed(Exception):
    """The engine refused or could not be reached when asked for memory back."""


@dataclass(frozen=True, slots=True)
class Need:
    bytes: int
    what: str  # "llama3.1:8b (4.90 GiB + 1.00 GiB context allowance)"
    key: str  # identifies the load: concurrent requests with the same key share one reservation
    model: str | None = None  # the model or checkpoint it loads, when the request names one (model files)


def json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None


def upstream_of(tenant: Tenant) -> str:
    if not tenant.upstream:
        raise ReleaseFailed(f"tenant {tenant.name!r} has no upstream to call")
    return tenant.upstream


def go_time(value: object) -> float | None:
    """An RFC 3339 timestamp as Go writes it (nanoseconds, offset or Z) in Unix seconds; None if unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


async def call_http(tenant: Tenant, client: httpx.AsyncClient, call: HttpCall | ReleaseSpec) -> dict[str, Any]:
    """One configured HTTP call (an `http` release, or its `resume`): a path goes to the upstream.
    Raises ReleaseFailed when refused (>= 400); httpx errors pass through."""
    url = call.url or ""
    if url.startswith("/"):
        url = upstream_of(tenant) + url
    r = await client.request(call.method, url, json=call.body)
    if r.status_code >= 400:
        raise ReleaseFailed(f"{call.method} {url} answered {r.status_code}")
    return {"call": f"{call.method} {url}", "status": r.status_code}


async def release_by_strategy(tenant: Tenant, client: httpx.AsyncClient, step: ReleaseSpec | None = None) -> dict[str, Any]:
    """Ask the tenant for its memory back the way its `release.kind` says (`step`: one of its release
    steps; default the first). Returns what was asked; the caller confirms on the GPU.

    The kinds that stop the app (process, systemd, docker) are no HTTP call: proxy/lifecycle/ runs them."""
    step = step or tenant.release_steps[0]
    kind = step.kind
    try:
        if kind == "ollama_unload":
            r = await client.get(f"{upstream_of(tenant)}/api/ps")
            r.raise_for_status()
            models = [m["name"] for m in r.json().get("models") or []]
            for name in models:
                u = await client.post(f"{upstream_of(tenant)}/api/generate", json={"model": name, "keep_alive": 0})
                if u.status_code >= 400:
                    raise ReleaseFailed(f"Ollama refused to unload {name}: {u.status_code} {u.text[:200]}")
            return {"call": "keep_alive 0", "models": models}
        if kind == "comfyui_free":
            payload = {"unload_models": step.unload_models, "free_memory": step.free_memory}
            r = await client.post(f"{upstream_of(tenant)}/free", json=payload)
            if r.status_code >= 400:
                raise ReleaseFailed(f"ComfyUI refused /free: {r.status_code}")
            return {"call": "POST /free", **payload}
        if kind == "http":
            try:
                return await call_http(tenant, client, step)
            except ReleaseFailed as exc:
                raise ReleaseFailed(f"release call {exc}") from None
    except httpx.HTTPError as exc:
        raise ReleaseFailed(f"cannot reach {tenant.name} at {tenant.upstream}: {exc}") from exc
    if step.stops:
        raise ReleaseFailed(f"tenant {tenant.name!r} is released by stopping it (kind {kind!r}): its lifecycle "
                            "controller (proxy/lifecycle/) does that, not an HTTP call")
    raise ReleaseFailed(tenant.not_reclaimable_reason)


async def resume_by_strategy(tenant: Tenant, client: httpx.AsyncClient, step: ReleaseSpec) -> dict[str, Any] | None:
    """Wake the app after `step` released it, before its next request is forwarded: the step's
    `resume` call (kind http). None when the step has none. Raises ReleaseFailed."""
    if step.resume is None:
        return None
    try:
        return await call_http(tenant, client, step.resume)
    except httpx.HTTPError as exc:
        raise ReleaseFailed(f"cannot reach {tenant.name} at {tenant.upstream} to resume it: {exc}") from exc
    except ReleaseFailed as exc:
        raise ReleaseFailed(f"resume call {exc}") from None
