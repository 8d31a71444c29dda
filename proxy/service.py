"""The whole proxy in one object: listeners per tenant, the admin API, the watchdog, one event loop.

`hyperswap serve` builds it with the NVML reader; `hyperswap demo` and the tests with the
simulated GPU. Ports of 0 are read back (tests); the registry's addresses are the defaults.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .admin import AdminApi
from .admission import Arbitration, GpuAdmission
from .clock import Clock, SystemClock
from .decisions import DecisionLog
from .errors import ConfigError
from .extensions import Extension, ExtensionFactory, default_extensions
from .forward import Forwarder
from .gpu import GpuReader
from .inflight import InFlight
from .listener import tenant_app
from .servers import DRAIN_S, RunningServer, split_host_port, start_server, stop_servers
from .tenants import Registry
from .watchdog import Watchdog

log = logging.getLogger("hyperswap")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def admin_token(registry: Registry, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    spec = registry.config.admin
    if spec.token_file:
        try:
            token = Path(spec.token_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read admin.token_file {spec.token_file}: {exc}") from None
        if token:
            return token
    return env.get(spec.token_env) or None


@dataclass(slots=True)
class Proxy:
    registry: Registry
    reader: GpuReader
    clock: Clock = field(default_factory=SystemClock)
    watchdog_enabled: bool = True
    extension_factories: list[ExtensionFactory] | None = None  # None: default_extensions()
    config_path: Path | None = None  # the tenants.json in use, for the health check
    drain_s: float = DRAIN_S  # on stop, what requests in flight get, in all, to finish
    inflight: InFlight = field(init=False)
    forwarder: Forwarder = field(init=False)
    decisions: DecisionLog = field(init=False)
    arbitration: Arbitration = field(init=False)
    watchdog: Watchdog = field(init=False)
    admission: GpuAdmission = field(init=False)
    servers: dict[str, RunningServer] = field(init=False, default_factory=dict)
    _pollers: list[object] = field(init=False, default_factory=list)
    extensions: list[Extension] = field(init=False, default_factory=list)
    token: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.inflight = InFlight(self.clock)
        self.forwarder = Forwarder()
        self.decisions = DecisionLog(self.clock)
        self.arbitration = Arbitration(self.registry, self.reader, self.inflight, self.clock, self.decisions)
        self.watchdog = Watchdog(self.arbitration)
        self.admission = GpuAdmission(self.arbitration)
        self.token = admin_token(self.registry)
        factories = default_extensions() if self.extension_factories is None else self.extension_factories
        self.extensions = [make(self) for make in factories]
        host, _ = split_host_port(self.registry.config.admin.listen)
        if host not in LOOPBACK and not self.token:
            raise ConfigError(
                f"the admin API would listen on {self.registry.config.admin.listen} without a token",
                fix=f"set {self.registry.config.admin.token_env} (or admin.token_file), or listen on 127.0.0.1")

    async def start(self, ports: Mapping[str, int] | None = None) -> None:
        """Bind every listener. `ports` overrides a listener's port by name ("admin" or a tenant)."""
        ports = dict(ports or {})
        admission = self.admission
        try:
            for tenant in self.registry:
                if not tenant.listen:
                    continue
                host, port = split_host_port(tenant.listen)
                app = tenant_app(tenant, self.forwarder, self.inflight, admission)
                self._pollers.append(app.state.poller)
                self.servers[tenant.name] = await start_server(app, host, ports.get(tenant.name, port), name=tenant.name)
            host, port = split_host_port(self.registry.config.admin.listen)
            for ext in self.extensions:
                await ext.start()
            admin = AdminApi(self.arbitration, self.watchdog, self.token)
            extra = [route for ext in self.extensions for route in ext.routes()]
            self.servers["admin"] = await start_server(admin.app(extra), host, ports.get("admin", port), name="admin")
        except OSError as exc:
            await self.stop()
            raise ConfigError(f"cannot listen: {exc}",
                              fix="another program holds that port: stop it, or change 'listen' in tenants.json") from None
        if self.watchdog_enabled:
            self.watchdog.start()

    async def stop(self) -> None:
        await self.watchdog.stop()
        for poller in self._pollers:
            await poller.stop()  # type: ignore[attr-defined]
        self._pollers.clear()
        # All listeners drain together, bounded in total (one after another took 5 s each).
        await stop_servers(list(self.servers.values()), self.drain_s)
        self.servers.clear()
        await self.admission.aclose()  # after the pollers and sockets that report OOMs are gone
        for ext in reversed(self.extensions):
            await ext.stop()
        await self.forwarder.aclose()
        await self.arbitration.aclose()

    def url(self, name: str) -> str:
        return self.servers[name].url
