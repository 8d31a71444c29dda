"""The release planner. PURE: no I/O, no clock, and no engine names (invariant 1).

`plan_release()` looks at one attributed snapshot, the registry and the tenants' busy states, and
says what to release so the requester can reach its need, or who is in the way. It only reads data
and returns data (a `Plan`); admission and the watchdog log it, return it, then execute it.

Rules (design.md, invariants 4 and 5):
- The requester is starved only if free memory plus what it already holds is below its need.
- Candidates are tenants other than the requester that hold memory, are idle, are reclaimable
  (release kind is not `none`) and rank strictly below the requester in priority. They are released
  lowest priority first (ties: larger holding first, then name), stopping once enough is freed.
- A release frees what the tenant's processes hold above the floor it keeps when idle
  (`idle_vram_bytes`: a server that stays up keeps its CUDA context; a runner that exits keeps nothing).
- Every process that holds memory and is not released is named as a blocker with its reason.
  Processes whose memory the driver does not report are never counted on.
- A need above the card's usable memory (total minus reserved) is infeasible whoever holds what.
- An infeasible plan still shows the releases it considered (what they would free); callers answer
  507 and execute none of them.

A tenant with no entry in `states` is idle: busy comes from traffic the proxy saw, and none was seen.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Mapping

from .attribution import UNMANAGED, AttributedProcess, AttributedSnapshot
from .tenants import GIB, Registry, Tenant

BlockReason = Literal["busy", "not_reclaimable", "not_lower_priority", "unmanaged", "requester", "unknown_memory"]

_MAX_NAMED = 4  # blockers named in the one-line explanation; the Plan lists them all


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


def _g(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class TenantState:
    name: str
    busy: bool
    busy_reason: str = ""
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Release:
    tenant: str
    expected_free_bytes: int
    pids: tuple[int, ...]
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"tenant": self.tenant, "expected_free_bytes": self.expected_free_bytes,
                "expected_free_gib": gib(self.expected_free_bytes), "pids": list(self.pids), "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Blocker:
    pid: int | None
    name: str
    tenant: str
    vram_bytes: int | None
    reason: BlockReason
    detail: str

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "name": self.name, "tenant": self.tenant, "vram_bytes": self.vram_bytes,
                "vram_gib": gib(self.vram_bytes), "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Plan:
    requester: str
    need_bytes: int
    free_bytes: int
    held_by_requester: int
    feasible: bool
    starved: bool
    releases: tuple[Release, ...]
    blockers: tuple[Blocker, ...]
    explanation: str
    estimated: bool

    @property
    def expected_free_bytes(self) -> int:
        return sum(r.expected_free_bytes for r in self.releases)

    def to_json(self) -> dict[str, object]:
        return {
            "requester": self.requester,
            "need_bytes": self.need_bytes, "need_gib": gib(self.need_bytes),
            "free_bytes": self.free_bytes, "free_gib": gib(self.free_bytes),
            "held_by_requester_bytes": self.held_by_requester, "held_by_requester_gib": gib(self.held_by_requester),
            "feasible": self.feasible,
            "starved": self.starved,
            "estimated": self.estimated,
            "releases": [r.to_json() for r in self.releases],
            "blockers": [b.to_json() for b in self.blockers],
            "explanation": self.explanation,
        }


def starved(snap: AttributedSnapshot, registry: Registry, tenant: str, need_bytes: int) -> bool:
    """Invariant 4: starved only if free memory plus what the tenant already holds is below its need."""
    del registry  # same signature as plan_release; what a tenant holds comes from attribution alone
    return snap.free_bytes + snap.held_by(tenant) < need_bytes


@dataclass(frozen=True, slots=True)
class _Holding:
    tenant: str
    procs: tuple[AttributedProcess, ...]
    known_bytes: int


def _holdings(snap: AttributedSnapshot) -> dict[str, _Holding]:
    groups: dict[str, list[AttributedProcess]] = defaultdict(list)
    for ap in snap.processes:
        # a process holding nothing known-nonzero is in nobody's way; unknown memory still counts as holding
        if ap.process.used_bytes is None or ap.process.used_bytes > 0:
            groups[ap.tenant].append(ap)
    return {t: _Holding(t, tuple(ps), sum(p.process.used_bytes or 0 for p in ps)) for t, ps in groups.items()}


def _why_not(tenant: Tenant | None, requester: Tenant | None, state: TenantState | None) -> tuple[BlockReason, str] | None:
    """Why this tenant cannot be released for the requester; None when it is a candidate.

    Order: configuration reasons first (they do not go away by waiting), busy last."""
    if tenant is None:
        return "unmanaged", "matches no tenant in tenants.json; the proxy cannot ask it for memory"
    rprio = requester.priority if requester is not None else 0
    if not tenant.reclaimable:
        return "not_reclaimable", tenant.not_reclaimable_reason
    if tenant.priority >= rprio:
        return "not_lower_priority", f"priority {tenant.priority} is not below the requester's {rprio}"
    if state is not None and state.busy:
        why = state.busy_reason or (f"{state.in_flight} request(s) in flight" if state.in_flight else "busy")
        return "busy", f"busy ({why}); a busy tenant is never released"
    return None


def plan_release(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
                 requester: str, need_bytes: int) -> Plan:
    free = snap.free_bytes
    held = snap.held_by(requester)
    device = snap.snapshot.device
    capacity = device.total_bytes - device.reserved_bytes
    req_tenant = registry.tenants.get(requester)
    rprio = req_tenant.priority if req_tenant is not None else 0
    is_starved = free + held < need_bytes
    estimated = snap.estimated
    head = f"{requester} needs {_g(need_bytes)}, {_g(free)} free" + (f" + {_g(held)} already held" if held else "")

    if not is_starved:
        return Plan(requester, need_bytes, free, held, True, False, (), (),
                    f"{head}: enough, no release needed", estimated)

    shortfall = need_bytes - free - held
    holdings = _holdings(snap)
    blockers: list[Blocker] = []
    candidates: list[tuple[Tenant, _Holding, int]] = []

    for name, h in holdings.items():
        if name == requester:
            continue
        tenant = None if name == UNMANAGED else registry.tenants.get(name)
        why = _why_not(tenant, req_tenant, states.get(name))
        if why is None:
            assert tenant is not None
            expected = max(0, h.known_bytes - tenant.idle_vram_bytes)
            if expected == 0 and h.known_bytes > 0:
                why = ("not_reclaimable",
                       f"holds only its idle floor of {_g(tenant.idle_vram_bytes)} (idle_vram_gb), which a release does not free")
            else:
                candidates.append((tenant, h, expected))
                continue
        reason, detail = why
        blockers.extend(Blocker(ap.process.pid, ap.process.name, name, ap.process.used_bytes, reason, detail)
                        for ap in h.procs)

    # lowest priority first; ties: larger holding first, then name (deterministic)
    candidates.sort(key=lambda c: (c[0].priority, -c[1].known_bytes, c[0].name))
    releases: list[Release] = []
    freed = 0
    for tenant, h, expected in candidates:
        if freed >= shortfall:
            break
        unknown = [ap for ap in h.procs if ap.process.used_bytes is None]
        why = f"idle, priority {tenant.priority} < {rprio}"
        if unknown:
            why += f"; {len(unknown)} process(es) with unknown memory not counted"
        releases.append(Release(tenant.name, expected, tuple(ap.process.pid for ap in h.procs), why))
        freed += expected

    too_large = need_bytes > capacity
    feasible = freed >= shortfall and not too_large

    if not feasible:
        # name every process in the way: unknown memory in released tenants was not counted on,
        # and the requester's own processes are listed so the numbers add up for a person
        released = {r.tenant for r in releases}
        for tenant_name in released:
            for ap in holdings[tenant_name].procs:
                if ap.process.used_bytes is None:
                    blockers.append(Blocker(ap.process.pid, ap.process.name, tenant_name, None, "unknown_memory",
                                            "released with its tenant, but the driver does not report its memory, so it is not counted on"))
        if requester in holdings:
            blockers.extend(Blocker(ap.process.pid, ap.process.name, requester, ap.process.used_bytes, "requester",
                                    "already held by the requester; counted toward its need")
                            for ap in holdings[requester].procs)
    blockers.sort(key=lambda b: (b.reason == "requester", -(b.vram_bytes or 0), b.tenant, b.pid or 0))

    if too_large:
        explanation = (f"{head}: the model is too large for this card ({_g(capacity)} usable in all); "
                       "no release can help")
        return Plan(requester, need_bytes, free, held, False, True, (), tuple(blockers), explanation, estimated)

    rel_text = ", ".join(
        f"{r.tenant} ({r.reason}" + (f", {_g(r.expected_free_bytes)})" if len(releases) > 1 else ")") for r in releases)
    if feasible:
        explanation = f"{head}: release {rel_text} to free {_g(freed)}"
    else:
        in_way = [b for b in blockers if b.reason != "requester"]
        named = "; ".join(
            f"{b.tenant} {b.name or '?'} pid {b.pid} ({b.reason.replace('_', ' ')}, "
            f"{_g(b.vram_bytes) if b.vram_bytes is not None else 'unknown'})" for b in in_way[:_MAX_NAMED])
        more = f"; and {len(in_way) - _MAX_NAMED} more" if len(in_way) > _MAX_NAMED else ""
        after = f" even after releasing {rel_text} ({_g(freed)})" if releases else ""
        explanation = (f"{head}: short by {_g(shortfall - freed)}{after}; in the way: "
                       f"{named or 'nothing the proxy can see'}{more}")
    return Plan(requester, need_bytes, free, held, feasible, True, tuple(releases), tuple(blockers), explanation, estimated)
