"""Cards and registries for the pure tests: the arbiter's plans and the handoff queue's decisions."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from proxy.config.registry import Registry
from proxy.config.units import GIB
from proxy.engines.loading import registry_from_dict
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot, SnapshotSource
from proxy.handoff.plan import TenantState

MIB = 2**20
TOTAL = 24 * GIB
RESERVED = 300 * MIB

STT = {
    "engine": "generic",
    "match": {"process_names": [], "cmdline_patterns": ["stt_relay.py"]},
    "priority": 45,
    "release": {"kind": "http", "url": "/release"},
    "idle_vram_gb": 0.0,
}


def registry(extra: Mapping[str, Any] | None = None, **settings: Any) -> Registry:
    """The shipped tenants plus `extra`; keyword sections (proxy=...) as in tenants.json."""
    # deep copy: registry_from_dict writes "name" into the dicts it is given
    return registry_from_dict({"tenants": copy.deepcopy(dict(extra or {})), **copy.deepcopy(settings)})


def snap(procs: list[tuple[str, int, int | None]], *, free: int | None = None, total: int = TOTAL,
         source: SnapshotSource = "simulated") -> AttributedSnapshot:
    """procs: (tenant, pid, used bytes). Free defaults to total - reserved - what is held."""
    held = sum(u or 0 for _, _, u in procs)
    free = total - RESERVED - held if free is None else free
    device = DeviceMemory(0, "test card", total, RESERVED, total - free - RESERVED, free)
    gps = tuple(GpuProcess(pid, f"{tenant}-proc", f"{tenant} --serve", used, float(pid)) for tenant, pid, used in procs)
    s = GpuSnapshot(device, gps, source=source)
    return AttributedSnapshot(s, tuple(AttributedProcess(p, t) for p, (t, _, _) in zip(gps, procs, strict=True)))


def idle(*names: str) -> dict[str, TenantState]:
    return {n: TenantState(n, busy=False) for n in names}


def busy(states: dict[str, TenantState], name: str, why: str = "1 request in flight") -> dict[str, TenantState]:
    return {**states, name: TenantState(name, busy=True, busy_reason=why, in_flight=1)}
