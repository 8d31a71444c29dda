"""Readiness after a start: poll the app until it answers, returning the moment it does.

The probe is an HTTP GET answering a status (the engine adapter's `ready_path`, or tenants.json's
`ready`) or, for an app that says nothing, its upstream port accepting a connection. Polls back off
from 10 ms to 25 ms: a cold start adds at most ~25 ms of waiting for the next probe beyond the app's
own start-to-ready time (a loopback probe costs about a millisecond, so even a two-minute start is
a few seconds of CPU), never a fixed sleep. The clock is injected for the deadline and the pauses.

A TCP probe only fits an app that opens its port once it serves: a container's published port is
opened by Docker's proxy before the app inside listens, and llama-server listens while it still
loads its model (answering 503 on /health), so those want an HTTP `ready` path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from proxy.clock import Clock
from proxy.config.schema import ReadySpec, Tenant
from proxy.lifecycle.controller import LifecycleError
from proxy.tls import client_context

FIRST_DELAY_S = 0.01
MAX_DELAY_S = 0.025
ATTEMPT_TIMEOUT_S = 2.0  # one probe; an app that accepts but does not answer is tried again

# Given the seconds left of the start's timeout; returns once ready, raises LifecycleError otherwise.
Readiness = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ReadyProbe:
    host: str
    port: int
    url: str | None  # GET this; None: a TCP connect to host:port
    status: int = 200

    def describe(self) -> str:
        """What readiness waits for: `GET http://... to answer 200`, `127.0.0.1:8081 to accept a connection`."""
        return f"GET {self.url} to answer {self.status}" if self.url else f"{self.host}:{self.port} to accept a connection"


def probe_for(tenant: Tenant, engine_ready_path: str | None) -> ReadyProbe:
    """The tenant's probe: tenants.json's `ready`, else the engine's (`adapter.ready_path`), else its port."""
    if not tenant.upstream:
        raise ValueError(f"tenant {tenant.name!r} has no upstream to probe")
    parts = urlsplit(tenant.upstream)
    spec = tenant.ready or ReadySpec()
    path = None if spec.tcp else spec.path or engine_ready_path
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return ReadyProbe(parts.hostname or "127.0.0.1", port, f"{tenant.upstream}{path}" if path else None, spec.status)


async def _tcp(probe: ReadyProbe, timeout_s: float) -> str | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(probe.host, probe.port), timeout_s)
    except (OSError, TimeoutError) as exc:
        return f"{probe.host}:{probe.port}: {str(exc) or type(exc).__name__}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def _http(probe: ReadyProbe, client: httpx.AsyncClient, timeout_s: float) -> str | None:
    assert probe.url is not None
    try:
        r = await client.get(probe.url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"GET {probe.url}: {str(exc) or type(exc).__name__}"
    return None if r.status_code == probe.status else f"GET {probe.url} answered {r.status_code}, not {probe.status}"


async def probe_once(probe: ReadyProbe, client: httpx.AsyncClient, timeout_s: float) -> str | None:
    """One try of the probe: None when it passes, else what went wrong."""
    return await (_http(probe, client, timeout_s) if probe.url else _tcp(probe, timeout_s))


async def wait_ready(probe: ReadyProbe, timeout_s: float, clock: Clock, *, client: httpx.AsyncClient | None = None,
                     exited: Callable[[], str | None] | None = None,
                     owner: Callable[[], Awaitable[str | None]] | None = None) -> float:
    """Poll until `probe` passes; return the seconds it took. Raises LifecycleError when `timeout_s`
    passes first, or at once when `exited()` says the app ended (a child that crashed), or when the
    probe passes but `owner()` says what answers is not the app the proxy started (the child ended
    while something else answers on its port, or another process holds the port)."""
    began = clock.now()
    deadline = began + timeout_s
    delay = FIRST_DELAY_S
    own = client is None
    if client is None:
        client = httpx.AsyncClient(trust_env=False, verify=client_context())
    try:
        while True:
            left = deadline - clock.now()
            attempt = max(0.05, min(ATTEMPT_TIMEOUT_S, left))
            why = await probe_once(probe, client, attempt)
            ended = exited() if exited else None
            if ended:
                raise LifecycleError(f"it {ended} before it was ready (the proxy waited for {probe.describe()})",
                                     fix="its last output lines say why")
            if why is None:
                stranger = await owner() if owner else None
                if stranger:
                    raise LifecycleError(f"not ready: {stranger}",
                                         fix="stop the other program, or give the tenant a port of its own "
                                             "(its upstream and its command)")
                return clock.now() - began
            left = deadline - clock.now()
            if left <= 0:
                raise LifecycleError(f"not ready within {timeout_s:g} s: {why}",
                                     fix="raise start_timeout_s if it only needs longer, else check its output and "
                                         "the ready probe in tenants.json")
            await clock.sleep(min(delay, left))
            delay = min(delay * 2, MAX_DELAY_S)
    finally:
        if own:
            await client.aclose()


def probe_readiness(probe: ReadyProbe, clock: Clock, *, exited: Callable[[], str | None] | None = None,
                    client: httpx.AsyncClient | None = None,
                    owner: Callable[[], Awaitable[str | None]] | None = None) -> Readiness:
    """`wait_ready` bound to one probe, as TenantLifecycle takes it."""

    async def ready(timeout_s: float) -> None:
        await wait_ready(probe, timeout_s, clock, client=client, exited=exited, owner=owner)

    return ready


# One try of a running tenant's probe (the liveness check): None when it answers, else why not.
Liveness = Callable[[], Awaitable[str | None]]


def probe_liveness(probe: ReadyProbe, client: httpx.AsyncClient | None = None) -> Liveness:
    """`probe_once` bound to one probe, with one try's timeout."""

    async def alive() -> str | None:
        if client is not None:
            return await probe_once(probe, client, ATTEMPT_TIMEOUT_S)
        async with httpx.AsyncClient(trust_env=False, verify=client_context()) as own:
            return await probe_once(probe, own, ATTEMPT_TIMEOUT_S)

    return alive
