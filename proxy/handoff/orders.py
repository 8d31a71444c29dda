"""Release orders: one release to run, whoever asked (the scheduler's own plans, the watchdog, the
admin API), and how it went. The scheduler runs them one at a time (`Scheduler.release`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.config.schema import Tenant
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.visibility import held_by_device
from proxy.handoff.decisions import HandoffKind, HandoffStarted, ReleaseResult
from proxy.handoff.plan import Plan, Release


@dataclass(frozen=True, slots=True)
class ReleaseOrder:
    """One release to run, whoever asked: the queue for a plan, the watchdog (idle deadline, spill
    relief) or the admin API. Recorded as one decision of `kind` before anything is asked."""
    requester: str  # the decision's tenant: whose load the memory is for, or the tenant released
    releases: tuple[Release, ...]
    trigger: str  # "request POST /api/generate", "watchdog idle", "admin"
    kind: HandoffKind
    plan: Plan | None = None  # the plan it carries out (None: a release with no load behind it)
    snapshot: AttributedSnapshot | None = None  # the card the order was made on
    held_bytes: int | None = None  # a whole-tenant release: what the tenant held, for the decision
    held_by_device: Mapping[int, int] = field(default_factory=dict)  # the same per card, on a host with several
    idle_s: float | None = None  # an idle release: the tenant's idle_release_after_s, for the decision
    stop: bool = False  # only the steps that stop the app (the admin's stop of a tenant the proxy starts)


@dataclass(slots=True)
class Released:
    """How a `ReleaseOrder` went: the decision recorded for it and each tenant's result."""
    order: ReleaseOrder
    results: list[ReleaseResult]
    decision: HandoffStarted | None  # None: nothing was asked (every tenant had work again)

    @property
    def ok(self) -> bool:
        return all(r.confirmed for r in self.results)


def release_whole(snap: AttributedSnapshot, tenant: Tenant, trigger: str, kind: HandoffKind, why: str,
                  idle_s: float | None = None) -> ReleaseOrder:
    """An order to release all a tenant holds above its idle floor, for no load in particular (the
    watchdog's idle release, the admin API's release)."""
    held = snap.held_by(tenant.name)
    pids = tuple(p.process.pid for p in snap.processes if p.tenant == tenant.name)
    release = Release(tenant.name, max(0, held - tenant.idle_vram_bytes), pids, why)
    by_device = held_by_device(snap, tenant.name) if snap.snapshot.several_devices else {}
    return ReleaseOrder(tenant.name, (release,), trigger, kind, None, snap, held, by_device, idle_s)


def stop_whole(snap: AttributedSnapshot, tenant: Tenant, trigger: str, why: str, kind: HandoffKind = "release",
               idle_s: float | None = None) -> ReleaseOrder:
    """An order to stop a tenant the proxy starts (the admin API's stop, its idle ttl): a release
    through its stopping step alone (soft steps before it skipped), so all it holds goes, its idle
    floor too."""
    held = snap.held_by(tenant.name)
    pids = tuple(p.process.pid for p in snap.processes if p.tenant == tenant.name)
    release = Release(tenant.name, held, pids, why)
    return ReleaseOrder(tenant.name, (release,), trigger, kind, None, snap, held_bytes=held, idle_s=idle_s, stop=True)
