"""What an admin-side feature sees of the proxy: a narrow, read-only view, not the `Proxy` itself.

Extensions (health, events, metrics, telemetry, MCP, OpenAPI, the dashboard, and whatever comes
next) observe the proxy's owners and never take part in a handoff. They get the attributes they
have always used, under the same names, as read-only properties over the running proxy (so a
test that changes `proxy.config_path` is seen at once), plus an explicit lookup of each other by
name. This module imports no extension and not `proxy.service`, so no import circle runs through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from starlette.routing import BaseRoute

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.engines.ports import HealthPorts
from proxy.gpu.snapshot import GpuReader
from proxy.handoff.broker import GpuBroker
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.inflight import InFlight
from proxy.handoff.watchdog import Watchdog
from proxy.relay.gpu_gate import GpuGate
from proxy.relay.servers import RunningServer


class Extension(Protocol):
    """An admin-side feature: routes on the admin listener and background work. One that others
    may look up (`ProxyView.extension`) says so with a class attribute `name`."""

    def routes(self) -> list[BaseRoute]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ProxyParts(Protocol):
    """What the view reads from the proxy (`proxy.service.Proxy` is one)."""

    registry: Registry
    reader: GpuReader
    clock: Clock
    config_path: Path | None
    config_note: str | None
    inflight: InFlight
    decisions: DecisionLog
    broker: GpuBroker
    gate: GpuGate
    watchdog: Watchdog
    servers: dict[str, RunningServer]
    extensions: list[Extension]
    token: str | None

    @property
    def engines(self) -> Callable[[Tenant], HealthPorts]: ...


class ProxyView:
    """The proxy as an extension sees it. Every attribute is read-only; the objects behind them are
    the proxy's own (read-mostly: an extension observes them, it does not replace them)."""

    __slots__ = ("_proxy", "_servers")

    def __init__(self, proxy: ProxyParts) -> None:
        self._proxy = proxy
        self._servers: Mapping[str, RunningServer] = MappingProxyType(proxy.servers)

    @property
    def registry(self) -> Registry:
        return self._proxy.registry

    @property
    def reader(self) -> GpuReader:
        return self._proxy.reader

    @property
    def simulated_gpu(self) -> bool:
        """The card is the simulator's (the demo, the tests): its engines are not the host's."""
        return getattr(self._proxy.reader, "simulated", False) is True

    def model_file_size(self, path: str) -> int | None:
        """On a simulated box, the size of the model a stand-in file stands for (the demo's files are
        small stand-ins, so sizes and load speeds are told as the model's); None on a real box, and
        for any other file."""
        sizes = getattr(self._proxy.reader, "model_file_sizes", None) if self.simulated_gpu else None
        size = sizes(path) if callable(sizes) else None
        return size if isinstance(size, int) else None

    @property
    def clock(self) -> Clock:
        return self._proxy.clock

    @property
    def config_path(self) -> Path | None:
        return self._proxy.config_path

    @property
    def config_note(self) -> str | None:
        """How the configuration was put together when no tenants.json alone says it (the demo's scenario)."""
        return self._proxy.config_note

    @property
    def inflight(self) -> InFlight:
        return self._proxy.inflight

    @property
    def decisions(self) -> DecisionLog:
        return self._proxy.decisions

    @property
    def broker(self) -> GpuBroker:
        return self._proxy.broker

    @property
    def engines(self) -> Callable[[Tenant], HealthPorts]:
        """Each tenant's engine adapter, as health and the events stream ask it: its probes, its installed
        models and their needs, its settings."""
        return self._proxy.engines

    @property
    def gate(self) -> GpuGate:
        """The tenant listeners' GPU gate (admission, forwarding, the OOM retry)."""
        return self._proxy.gate

    @property
    def watchdog(self) -> Watchdog:
        return self._proxy.watchdog

    @property
    def servers(self) -> Mapping[str, RunningServer]:
        """The running listeners by name ("admin" or a tenant), as they are now."""
        return self._servers

    @property
    def token(self) -> str | None:
        return self._proxy.token

    def extension(self, name: str) -> Extension | None:
        """The running extension that calls itself `name` (its class attribute `name`), if any.
        The caller checks it offers what it needs (a runtime-checkable protocol of its own)."""
        return next((ext for ext in self._proxy.extensions if getattr(ext, "name", None) == name), None)
