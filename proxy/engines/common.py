"""Engine-neutral pieces every adapter shares: what a load needs, a failed release, asking a tenant's
release step for its memory back, and small wire helpers.

Nothing here knows an engine by name; `proxy/engines/<kind>.py` does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime

import httpx

from proxy.config.schema import ReleaseFailed as ReleaseFailed  # re-exported: every adapter raises it
from proxy.config.schema import ReleaseSpec, Tenant


@dataclass(frozen=True, slots=True)
class Need:
    bytes: int
    what: str  # "llama3.1:8b (4.90 GiB + 1.00 GiB context allowance)"
    key: str  # identifies the load: concurrent requests with the same key share one reservation
    model: str | None = None  # the model or checkpoint it loads, when the request names one (model files)


def json_or_none(body: bytes) -> object:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None


def named_in_head(head: bytes, fields: tuple[str, ...]) -> str | None:
    """The first string value of one of `fields` in the head of a JSON body (too large to parse
    whole): `"model": "gemma3:27b"` -> gemma3:27b. None when none appears in it."""
    for field in fields:
        found = re.search(rb'"' + re.escape(field.encode()) + rb'"\s*:\s*"((?:[^"\\]|\\.){1,512})"', head)
        if found is not None:
            try:
                value = json.loads(b'"' + found.group(1) + b'"')
            except ValueError:
                continue
            if isinstance(value, str) and value:
                return value
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


async def release_by_strategy(tenant: Tenant, client: httpx.AsyncClient, step: ReleaseSpec | None = None) -> dict[str, object]:
    """Ask the tenant for its memory back the way its release kind says (`step`: one of its release
    steps; default the first): each kind's model carries its own `release()` (proxy/engines/release_kinds.py
    lists them). Returns what was asked; the caller confirms on the GPU.

    The kinds that stop the app (process, systemd, docker) are no HTTP call: proxy/lifecycle/ runs them."""
    step = step or tenant.release_steps[0]
    try:
        return await step.release(tenant, client)
    except httpx.HTTPError as exc:
        raise ReleaseFailed(f"cannot reach {tenant.name} at {tenant.upstream}: {exc}") from exc


async def resume_by_strategy(tenant: Tenant, client: httpx.AsyncClient, step: ReleaseSpec) -> dict[str, object] | None:
    """Wake the app after `step` released it, before its next request is forwarded: the step's
    resume call (kind http). None when the step has none. Raises ReleaseFailed."""
    return await step.wake(tenant, client)
