"""The whole proxy in one object: listeners per tenant, the admin API, the watchdog, one event loop.

`hyperswap serve` builds it with the NVML reader; `hyperswap demo` and the tests with the
simulated GPU. Ports of 0 are read back (tests); the registry's addresses are the defaults.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proxy.admin.api import AdminApi
from proxy.admin.extensions import Extension, ExtensionFactory, default_extensions
from proxy.admin.proxy_view import ProxyView
from proxy.clock import Clock, SystemClock
from proxy.config.registry import Registry
from proxy.engines import AdapterCache
from proxy.errors import ConfigError
from proxy.gpu.snapshot import GpuReader
from proxy.handoff.broker import GpuBroker
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.inflight import InFlight
from proxy.handoff.watchdog import Watchdog
from proxy.lifecycle.build import default_state_dir
from proxy.lifecycle.cuda_driver import Checkpointer
from proxy.lifecycle.record import instance_dir
from proxy.lifecycle.state import LifecycleReport
from proxy.relay.forward import Forwarder
from proxy.relay.gpu_gate import GpuGate
from proxy.relay.listener import TenantApp
from proxy.relay.servers import DRAIN_S, RunningServer, split_host_port, start_server, stop_servers
from proxy.tasks import cancel_and_wait

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


def listen_error(exc: OSError, who: str, address: str, source: Path | None) -> ConfigError:
    """A bind failure as the operator needs it: which listener, which address, which file, and the
    fix for that errno (a taken port and a host that does not resolve need different ones)."""
    key = "admin.listen" if who == "admin" else f"tenants.{who}.listen"
    where = f"{key} in {source}" if source else f"{key} in a tenants.json of your own (--config PATH)"
    host, _, port = address.rpartition(":")
    if isinstance(exc, socket.gaierror):
        fix = f"{host} does not resolve: use an IP address (127.0.0.1) or a name in /etc/hosts in {where}"
    elif exc.errno == errno.EADDRINUSE:
        fix = (f"another program holds port {port} (`ss -ltnp 'sport = :{port}'` names it): stop it, "
               f"or choose another port in {where}")
    elif exc.errno == errno.EADDRNOTAVAIL:
        fix = f"{host} is not an address of this machine: use 127.0.0.1 or one `ip -brief addr` lists in {where}"
    elif exc.errno == errno.EACCES:
        fix = (f"ports below 1024 need root or CAP_NET_BIND_SERVICE: use a port of 1024 or more in {where}, "
               "or grant the capability")
    else:
        fix = f"check {where}"
    what = "the admin API" if who == "admin" else f"tenant {who}"
    reason = exc.strerror or str(exc)
    return ConfigError(f"{what} cannot listen on {address}: {reason}", fix=fix)


@dataclass(slots=True)
class Proxy:
    registry: Registry
    reader: GpuReader
    clock: Clock = field(default_factory=SystemClock)
    watchdog_enabled: bool = True
    extension_factories: list[ExtensionFactory] | None = None  # None: default_extensions()
    config_path: Path | None = None  # the tenants.json in use, for the health check
    config_note: str | None = None  # how the configuration was put together, when not a tenants.json alone (the demo)
    drain_s: float = DRAIN_S  # on stop, what requests in flight get, in all, to finish
    # the proxy's state, a folder per instance: records of the apps it starts, Ollama's footprints (None:
    # default_state_dir)
    lifecycle_dir: Path | None = None
    checkpointer: Checkpointer | None = None  # the CUDA suspend seam (the demo's); None: the driver's, checked here
    inflight: InFlight = field(init=False)
    forwarder: Forwarder = field(init=False)
    engines: AdapterCache = field(init=False)
    decisions: DecisionLog = field(init=False)
    broker: GpuBroker = field(init=False)
    watchdog: Watchdog = field(init=False)
    gate: GpuGate = field(init=False)
    servers: dict[str, RunningServer] = field(init=False, default_factory=dict)
    _pollers: list[object] = field(init=False, default_factory=list)
    _preloads: list[asyncio.Task[LifecycleReport | None]] = field(init=False, default_factory=list)  # preload starts under way
    extensions: list[Extension] = field(init=False, default_factory=list)
    token: str | None = field(init=False, default=None)
    view: ProxyView = field(init=False)  # what extensions get: read-only, never the Proxy itself

    def __post_init__(self) -> None:
        self.inflight = InFlight(self.clock)
        state_dir = instance_dir(self.lifecycle_dir or default_state_dir(), self.registry.config.admin.listen)
        self.forwarder = Forwarder(state_dir=state_dir)  # what the adapters learn (Ollama's footprints) is kept there
        self.decisions = DecisionLog(self.clock)
        # each tenant's engine adapter, one per tenant (the forwarder's), shared by every part that asks an
        # engine, each through the ports it asks (what an adapter learns, Ollama's model sizes, is learnt once)
        self.engines = self.forwarder.adapter
        self.broker = GpuBroker(self.registry, self.reader, self.inflight, self.clock, self.decisions,
                                adapter=self.engines, state_dir=state_dir, checkpointer=self.checkpointer)
        self.watchdog = Watchdog(self.broker, self.engines)
        self.gate = GpuGate(self.broker, self.engines)
        self.token = admin_token(self.registry)
        factories = default_extensions() if self.extension_factories is None else self.extension_factories
        self.view = ProxyView(self)
        self.extensions = [make(self.view) for make in factories]
        host, _ = split_host_port(self.registry.config.admin.listen)
        if host not in LOOPBACK and not self.token:
            raise ConfigError(
                f"the admin API would listen on {self.registry.config.admin.listen} without a token",
                fix=f"set {self.registry.config.admin.token_env} (or admin.token_file), or listen on 127.0.0.1")

    async def start(self, ports: Mapping[str, int] | None = None) -> None:
        """Bind every listener. `ports` overrides a listener's port by name ("admin" or a tenant)."""
        ports = dict(ports or {})
        gate = self.gate
        binding: tuple[str, str] | None = None  # (who, host:port) while a bind is under way
        try:
            for tenant in self.registry:
                if not tenant.listen:
                    continue
                host, port = split_host_port(tenant.listen)
                app = TenantApp(tenant, self.forwarder, self.inflight, gate)
                self._pollers.append(app.poller)
                binding = (tenant.name, f"{host}:{ports.get(tenant.name, port)}")
                self.servers[tenant.name] = await start_server(app, host, ports.get(tenant.name, port), name=tenant.name)
                binding = None
            host, port = split_host_port(self.registry.config.admin.listen)
            for ext in self.extensions:
                await ext.start()
            admin = AdminApi(self.broker, self.watchdog, self.engines, self.token,
                             listeners={name: server.url for name, server in self.servers.items()},
                             closing=self._admin_closing)
            extra = [route for ext in self.extensions for route in ext.routes()]
            binding = ("admin", f"{host}:{ports.get('admin', port)}")
            self.servers["admin"] = await start_server(admin.app(extra), host, ports.get("admin", port), name="admin")
        except OSError as exc:
            await self.stop()
            if binding is None:
                raise ConfigError(f"cannot start: {exc}") from None
            raise listen_error(exc, *binding, self.config_path or self.registry.source) from None
        await self.broker.lifecycles.adopt()  # a unit or container already up runs on
        self._preloads = [asyncio.create_task(self.broker.starter.preload(t), name=f"hyperswap:preload:{t.name}")
                          for t in self.registry if t.preload and t.name in self.broker.lifecycles]
        if self.watchdog_enabled:
            self.watchdog.start()

    async def stop(self) -> None:
        await cancel_and_wait(self._preloads)  # a start under way goes on to its end: the lifecycle's own task
        self._preloads.clear()
        await self.watchdog.stop()
        for poller in self._pollers:
            await poller.stop()  # type: ignore[attr-defined]
        self._pollers.clear()
        # All listeners drain together, bounded in total (one after another took 5 s each).
        await stop_servers(list(self.servers.values()), self.drain_s)
        self.servers.clear()
        await self.gate.aclose()  # after the pollers and sockets that report OOMs are gone
        for ext in reversed(self.extensions):
            await ext.stop()
        await self.forwarder.aclose()
        await self.broker.aclose()  # with the apps the proxy started itself

    def _admin_closing(self) -> bool:
        """The admin server has been told to stop (its open streams end)."""
        admin = self.servers.get("admin")
        return admin is None or admin.server.should_exit

    def url(self, name: str) -> str:
        return self.servers[name].url
