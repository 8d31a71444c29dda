"""From a tenant in tenants.json to its controller and its state machine. The controller is built by
the tenant's stopping release step itself (`StoppingRelease.controller`); this only hands it the tools."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from proxy.clock import Clock
from proxy.config.schema import Tenant
from proxy.lifecycle.controller import Controller, ControllerTools, StoppingRelease
from proxy.lifecycle.process import ProcessController
from proxy.lifecycle.ready import probe_for, probe_liveness, probe_readiness
from proxy.lifecycle.state import Backoff, OnDone, TenantLifecycle


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the records of the `process` tenants live (in a folder per instance: `record.py`), so a
    restarted proxy can end or name what its last run left: under systemd's state directory when the
    service has one (`StateDirectory=hyperswap` sets `$STATE_DIRECTORY`: `/var/lib/hyperswap` for the
    system unit, whose home is read-only), else `$XDG_STATE_HOME/hyperswap/lifecycle`
    (`~/.local/state/...`)."""
    env = os.environ if env is None else env
    given = env.get("STATE_DIRECTORY", "").split(":")[0]  # systemd: several folders are joined by ':'
    if given:
        return Path(given) / "lifecycle"
    state = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".local" / "state")
    return Path(state) / "hyperswap" / "lifecycle"


def controller_for(tenant: Tenant, *, clock: Clock, state_dir: Path | None = None,
                   systemctl: str | Sequence[str] = "systemctl",
                   docker_transport: httpx.AsyncBaseTransport | None = None,
                   withheld_env: Iterable[str] = ()) -> Controller | None:
    """The controller of the tenant's stopping release step, built by its kind; None when its release
    stops nothing. `withheld_env`: variables a started process never inherits besides HYPERSWAP_*
    (the admin token's)."""
    spec = tenant.lifecycle
    if spec is None:
        return None
    if not isinstance(spec, StoppingRelease):
        raise TypeError(f"release kind {spec.kind!r} stops the app but is no StoppingRelease: it builds no controller")
    return spec.controller(tenant, ControllerTools(clock=clock, state_dir=state_dir, systemctl=systemctl,
                                                   docker_transport=docker_transport, withheld_env=withheld_env))


def lifecycle_for(tenant: Tenant, engine_ready_path: str | None, *, clock: Clock, state_dir: Path | None = None,
                  systemctl: str | Sequence[str] = "systemctl", docker_transport: httpx.AsyncBaseTransport | None = None,
                  client: httpx.AsyncClient | None = None, backoff: Backoff | None = None,
                  on_report: OnDone | None = None, withheld_env: Iterable[str] = ()) -> TenantLifecycle | None:
    """The tenant's state machine, with its controller and readiness probe (`engine_ready_path`:
    `adapter_for(tenant).ready_path`); None for a tenant the proxy does not start and stop."""
    controller = controller_for(tenant, clock=clock, state_dir=state_dir, systemctl=systemctl,
                                docker_transport=docker_transport, withheld_env=withheld_env)
    if controller is None:
        return None
    probe = probe_for(tenant, engine_ready_path)
    owner = None
    if isinstance(controller, ProcessController):
        owner = controller.owns_port
        if probe.url is not None:  # the probe's own requests, as access logs print them, are not the app's story
            controller.hide = f"GET {urlsplit(probe.url).path} HTTP/"
    ready = probe_readiness(probe, clock, exited=controller.exited, client=client, owner=owner)
    return TenantLifecycle(tenant.name, controller, ready, start_timeout_s=tenant.start_timeout_s, clock=clock,
                           backoff=backoff, on_report=on_report, live=probe_liveness(probe, client),
                           restart=tenant.restart, restart_limit=tenant.restart_limit, preload=tenant.preload)
