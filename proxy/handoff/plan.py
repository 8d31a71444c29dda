"""The handoff's decisions. PURE: no I/O, no clock, and no engine names (invariant 1).

`plan_release()` looks at one attributed snapshot, the registry and the tenants' busy states, and
says what to release so the requester can reach its need, whether waiting for busy tenants would
help, or who is in the way for good. `policy.schedule()` applies it to the queue of waiting
requests. Both only read data and return data; the scheduler and the watchdog log the result,
return it, then execute it. `plan_release()` is two steps
read on their own: `decide()` gathers the facts (`PlanFacts`: holdings, candidates, the releases
chosen, the busy tenants waited for, the blockers with their reasons, the shortfall), and
`explain()` writes the plan's one line from those facts alone.

Rules (design.md, invariants 4 and 5):
- The requester is starved only if free memory (less what admitted loads were promised and have
  not reached the card yet) plus what it already holds is below its need.
- A request takes memory from any idle, reclaimable tenant whatever its priority (idle memory serves
  whoever asks), unless that tenant ranks above the requester and sets `protect_idle_memory`. The
  watchdog's background relief of a starved busy tenant (mode "relief") takes only from tenants
  strictly below it. Candidates are released lowest priority first (ties: larger holding first,
  then name), stopping once enough is freed; then any release the final set does not need is
  dropped, and nothing that would free 0 bytes is released.
- A release frees what the tenant's processes hold above the floor it keeps when idle
  (`idle_vram_bytes`: a server that stays up keeps its CUDA context; a runner that exits keeps nothing).
- A busy tenant is never released. Memory a busy, reclaimable tenant holds is waited for: the plan is
  not feasible now but `possible`, and `wait_for` names the busy tenants. Only a need that cannot be
  met even if every busy tenant went idle and every reclaimable one were released is impossible (507).
- Every process that holds memory and is not released is named as a blocker with its reason. A
  plan that waits or is refused lists the idle releases it counts on; only a feasible plan's run
  (a waiting request is planned again once the busy tenants finish).
  Processes whose memory the driver does not report are never counted on.
- A need above the card's usable memory (total minus reserved) is impossible whoever holds what.

A tenant with no entry in `states` is idle: busy comes from traffic the proxy saw, and none was seen.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.gpu.attribution import UNMANAGED, AttributedProcess, AttributedSnapshot

BlockReason = Literal["busy", "not_reclaimable", "protected", "not_lower_priority", "unmanaged", "requester",
                     "unknown_memory"]
PlanMode = Literal["request", "relief"]
Outcome = Literal["ready", "release", "wait", "impossible", "unplanned"]

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
    stale_jobs: tuple[str, ...] = ()  # listed as running, but the evidence says not (proxy/handoff/busy.py)
    stale_why: str = ""  # "vram": at its idle floor on the card; "unlisted": its own queue no longer lists them;
    # "unreachable": its queue has not answered for proxy.job_lost_after_s


@dataclass(frozen=True, slots=True)
class Release:
    tenant: str
    expected_free_bytes: int
    pids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Blocker:
    pid: int | None
    name: str
    tenant: str
    vram_bytes: int | None
    reason: BlockReason
    detail: str


@dataclass(frozen=True, slots=True)
class Plan:
    requester: str
    need_bytes: int
    free_bytes: int
    held_by_requester: int
    feasible: bool  # enough now, with `releases`
    starved: bool
    releases: tuple[Release, ...]
    blockers: tuple[Blocker, ...]
    explanation: str
    estimated: bool
    possible: bool = True  # enough once the busy tenants in `wait_for` finish; False: refuse (507)
    wait_for: tuple[str, ...] = ()
    promised_bytes: int = 0  # free memory already promised to admitted loads not on the card yet
    reachable_bytes: int = 0  # free + held + every reclaimable tenant's memory, busy or idle: the most it could get
    unplanned: bool = False  # nothing to plan with (the card's size is unknown): forwarded as it is
    device: int | None = None  # the card planned on, on a host with several (proxy/handoff/devices.py); None: one card
    device_name: str = ""

    @property
    def expected_free_bytes(self) -> int:
        return sum(r.expected_free_bytes for r in self.releases)

    @property
    def outcome(self) -> Outcome:
        if self.unplanned:
            return "unplanned"
        if self.feasible:
            return "release" if self.releases else "ready"
        return "wait" if self.possible else "impossible"


UNPLANNED_WHY = "the card's size is unknown (the GPU reader failed and no engine reports the device)"


def unplanned_plan(requester: str, need_bytes: int) -> Plan:
    """What a request gets when there is nothing to plan with: forwarded as it is, never held back
    or refused (invariant 10). The dry run and the handoff queue both answer this."""
    return Plan(requester, need_bytes, 0, 0, True, False, (), (), f"forwarded without a plan: {UNPLANNED_WHY}",
                True, unplanned=True)


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


def _why_never(tenant: Tenant | None, rprio: int, mode: PlanMode) -> tuple[BlockReason, str] | None:
    """Why this tenant's memory can never serve the requester, busy or not; None when it can."""
    if tenant is None:
        return "unmanaged", "matches no tenant in tenants.json; the proxy cannot ask it for memory"
    if not tenant.reclaimable:
        return "not_reclaimable", tenant.not_reclaimable_reason
    if mode == "relief" and tenant.priority >= rprio:
        return "not_lower_priority", (f"priority {tenant.priority} is not below {rprio}: a busy tenant's background "
                                      "relief only takes from tenants below it")
    if mode == "request" and tenant.protect_idle_memory and tenant.priority > rprio:
        return "protected", (f"priority {tenant.priority} above the requester's {rprio} and protect_idle_memory "
                             "is set in tenants.json")
    return None


def _busy_detail(state: TenantState) -> str:
    why = state.busy_reason or (f"{state.in_flight} request(s) in flight" if state.in_flight else "busy")
    return f"busy ({why}); a busy tenant is never released: the request waits for it to finish"


def _release_reason(tenant: Tenant, rprio: int, unknown: int) -> str:
    # Priority orders the releases (lowest first); it never keeps an idle tenant's memory from a
    # request (only protect_idle_memory does, and such a tenant is no candidate): said so, since
    # "priority 60 >= 40" read as if it had.
    p = tenant.priority
    if p < rprio:
        why = f"idle, priority {p} below the requester's {rprio}"
    else:
        why = f"idle; priority {p}, {'above' if p > rprio else 'equal to'} the requester's {rprio}, does not protect idle memory"
    if unknown:
        why += f"; {unknown} process(es) with unknown memory not counted"
    return why


def _choose(cands: Sequence[_Candidate], shortfall: int) -> list[_Candidate]:
    """Lowest priority first until enough is freed, then drop any the rest already covers (a
    higher-priority release alone may make a lower one unnecessary); never a release of 0 bytes."""
    chosen: list[_Candidate] = []
    freed = 0
    for c in cands:
        if freed >= shortfall:
            break
        if c.expected > 0:
            chosen.append(c)
            freed += c.expected
    if freed >= shortfall:
        for c in list(chosen):
            if freed - c.expected >= shortfall:
                chosen.remove(c)
                freed -= c.expected
    return chosen


# -- deciding: the facts a plan is made of ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Candidate:
    """A tenant whose memory may serve the requester: idle now (`state` None), or busy and waited for."""
    tenant: Tenant
    holding: _Holding
    expected: int  # what its release frees: its known memory above its idle floor
    state: TenantState | None = None


@dataclass(frozen=True, slots=True)
class PlanFacts:
    """What `decide()` found, before a word is written about it: `explain()` turns it into the
    plan's one line, `plan_release()` into the Plan."""
    requester: str
    need_bytes: int
    free_bytes: int
    promised_bytes: int
    held_bytes: int  # by the requester, counted toward its need
    capacity_bytes: int  # the card's total less what it reserves
    shortfall: int  # what free (less promised) and held memory lack; <= 0: not starved
    reachable: int  # free + held + every candidate's memory, busy or idle: the most the requester could get
    feasible: bool = True  # enough now, with the chosen releases
    # enough once every busy tenant went idle, every reclaimable one were released, and the loads
    # promised now had come and gone (they are reclaimable in turn once their tenant is idle)
    possible: bool = True
    freed: int = 0  # what the chosen releases free
    holdings: tuple[_Holding, ...] = ()  # per tenant, its processes holding memory (the requester's too)
    idle: tuple[_Candidate, ...] = ()  # idle candidates, in release order
    waitable: tuple[_Candidate, ...] = ()  # busy candidates, in release order
    chosen: tuple[Release, ...] = ()  # the releases taken from `idle`
    waited: tuple[_Candidate, ...] = ()  # the busy candidates the request waits for (a prefix of `waitable`)
    blockers: tuple[Blocker, ...] = ()  # sorted: biggest first, the requester's own last

    @property
    def starved(self) -> bool:
        return self.shortfall > 0

    @property
    def too_large(self) -> bool:
        return self.need_bytes > self.capacity_bytes

    @property
    def releases(self) -> tuple[Release, ...]:
        """The releases the Plan lists: the chosen ones, also when the request waits (it counts on
        them) or is refused (they are named, not in the way); none when no release can help."""
        return () if self.too_large else self.chosen


def _classify(h: _Holding, tenant: Tenant | None, state: TenantState | None, rprio: int,
              mode: PlanMode) -> tuple[_Candidate | None, tuple[BlockReason, str] | None]:
    """A holder as a candidate, a blocker's reason, or both (a busy candidate is waited for and in the way now)."""
    never = _why_never(tenant, rprio, mode)
    if never is not None:
        return None, never
    assert tenant is not None  # an unmanaged holder is never a candidate
    expected = max(0, h.known_bytes - tenant.idle_vram_bytes)
    if state is not None and state.busy:
        return _Candidate(tenant, h, expected, state), ("busy", _busy_detail(state))
    if expected > 0:
        return _Candidate(tenant, h, expected), None
    if h.known_bytes > 0:
        return None, ("not_reclaimable", f"holds only its idle floor of {_g(tenant.idle_vram_bytes)} (idle_vram_gb), "
                                         "which a release does not free")
    return None, ("unknown_memory", "idle, but the driver does not report its memory, so no release is counted on")


def _sort_holders(holdings: Mapping[str, _Holding], registry: Registry, states: Mapping[str, TenantState],
                  requester: str, rprio: int, mode: PlanMode) -> tuple[list[_Candidate], list[_Candidate], list[Blocker]]:
    """Every holder but the requester: idle candidates, busy candidates, and the blockers, each
    process of a holder that is in the way named with its tenant's reason."""
    idle: list[_Candidate] = []
    waitable: list[_Candidate] = []
    blockers: list[Blocker] = []
    for name, h in holdings.items():
        if name == requester:
            continue
        tenant = None if name == UNMANAGED else registry.tenants.get(name)
        cand, why = _classify(h, tenant, states.get(name), rprio, mode)
        if cand is not None:
            (idle if cand.state is None else waitable).append(cand)
        if why is not None:
            reason, detail = why
            blockers.extend(Blocker(ap.process.pid, ap.process.name, name, ap.process.used_bytes, reason, detail)
                            for ap in h.procs)
    # lowest priority first; at equal priority a tenant whose release parks it in host RAM (cuda_suspend)
    # first: undone by a restore (~12 GB/s, hold.RESTORE_BYTES_PER_S), not a reload (~2 GB/s); then biggest
    order = lambda c: (c.tenant.priority, not _parks(c.tenant), -c.holding.known_bytes, c.tenant.name)  # noqa: E731
    return sorted(idle, key=order), sorted(waitable, key=order), blockers


def _parks(tenant: Tenant) -> bool:
    """Its first release step suspends it into host RAM (release kind cuda_suspend)."""
    return bool(tenant.release_steps) and tenant.release_steps[0].suspends


def _release_of(c: _Candidate, rprio: int) -> Release:
    unknown = sum(1 for ap in c.holding.procs if ap.process.used_bytes is None)
    return Release(c.tenant.name, c.expected, tuple(ap.process.pid for ap in c.holding.procs),
                   _release_reason(c.tenant, rprio, unknown))


def _to_wait_for(waitable: Sequence[_Candidate], covered: int, shortfall: int) -> tuple[_Candidate, ...]:
    """The busy candidates to wait for, in release order, until what they hold covers the shortfall."""
    waited: list[_Candidate] = []
    for c in waitable:
        if covered >= shortfall:
            break
        waited.append(c)
        covered += c.expected
    return tuple(waited)


def _named_when_short(releases: Sequence[Release], holdings: Mapping[str, _Holding], requester: str) -> list[Blocker]:
    """The rest of the processes a plan short of memory names: unknown memory in released tenants
    was not counted on, and the requester's own processes are listed so the numbers add up for a person."""
    out = [Blocker(ap.process.pid, ap.process.name, r.tenant, None, "unknown_memory",
                   "released with its tenant, but the driver does not report its memory, so it is not counted on")
           for r in releases for ap in holdings[r.tenant].procs if ap.process.used_bytes is None]
    if requester in holdings:
        out.extend(Blocker(ap.process.pid, ap.process.name, requester, ap.process.used_bytes, "requester",
                           "already held by the requester; counted toward its need")
                   for ap in holdings[requester].procs)
    return out


def decide(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
           requester: str, need_bytes: int, *, promised: Mapping[str, int] | None = None,
           mode: PlanMode = "request") -> PlanFacts:
    """The facts of `plan_release()`, arguments as there: who holds what, who could give it, what
    is chosen, who is waited for, who is in the way and why."""
    free = snap.free_bytes
    promised_bytes = sum(promised.values()) if promised else 0
    held = snap.held_by(requester)
    capacity = snap.snapshot.device.total_bytes - snap.snapshot.device.reserved_bytes
    shortfall = need_bytes - (free - promised_bytes) - held
    if shortfall <= 0:
        return PlanFacts(requester, need_bytes, free, promised_bytes, held, capacity, shortfall, free + held)
    req_tenant = registry.tenants.get(requester)
    rprio = req_tenant.priority if req_tenant is not None else 0
    holdings = _holdings(snap)
    idle, waitable, blockers = _sort_holders(holdings, registry, states, requester, rprio, mode)
    chosen = tuple(_release_of(c, rprio) for c in _choose(idle, shortfall))
    freed = sum(r.expected_free_bytes for r in chosen)
    idle_total = sum(c.expected for c in idle)
    reachable = free + held + idle_total + sum(c.expected for c in waitable)
    too_large = need_bytes > capacity
    feasible = freed >= shortfall and not too_large
    possible = not too_large and reachable >= need_bytes
    waited: tuple[_Candidate, ...] = ()
    if not feasible:
        blockers += _named_when_short(chosen, holdings, requester)
        if possible:
            waited = _to_wait_for(waitable, idle_total, shortfall)
    blockers.sort(key=lambda b: (b.reason == "requester", -(b.vram_bytes or 0), b.tenant, b.pid or 0))
    return PlanFacts(requester, need_bytes, free, promised_bytes, held, capacity, shortfall, reachable, feasible, possible,
                     freed, tuple(holdings.values()), tuple(idle), tuple(waitable), chosen, waited, tuple(blockers))


# -- explaining: the plan's one line, from the facts alone -----------------------------------------

def _head(f: PlanFacts) -> str:
    return (f"{f.requester} needs {_g(f.need_bytes)}, {_g(f.free_bytes)} free"
            + (f" ({_g(f.promised_bytes)} promised to loads under way)" if f.promised_bytes else "")
            + (f" + {_g(f.held_bytes)} already held" if f.held_bytes else ""))


def _releases_text(releases: Sequence[Release]) -> str:
    sizes = len(releases) > 1  # one release's size is the total the line ends with
    return ", ".join(f"{r.tenant} ({r.reason}" + (f", {_g(r.expected_free_bytes)})" if sizes else ")") for r in releases)


def _waiting_text(waited: Sequence[_Candidate]) -> str:
    if not waited:
        return "loads already admitted to reach the card and their tenants to go idle"
    busy = "; ".join(f"{c.tenant.name} ({(c.state.busy_reason if c.state else '') or 'busy'}, "
                     f"{_g(c.expected)} above its floor)" for c in waited)
    return f"busy {busy} to finish"


def _in_the_way_text(blockers: Sequence[Blocker]) -> str:
    in_way = [b for b in blockers if b.reason != "requester"]
    named = "; ".join(
        f"{b.tenant} {b.name or '?'} pid {b.pid} ({b.reason.replace('_', ' ')}, "
        f"{_g(b.vram_bytes) if b.vram_bytes is not None else 'unknown'})" for b in in_way[:_MAX_NAMED])
    more = f"; and {len(in_way) - _MAX_NAMED} more" if len(in_way) > _MAX_NAMED else ""
    return f"{named or 'nothing the proxy can see'}{more}"


def explain(f: PlanFacts) -> str:
    """The plan's one-line explanation."""
    head = _head(f)
    if not f.starved:
        return f"{head}: enough, no release needed"
    if f.too_large:
        return f"{head}: the model is too large for this card ({_g(f.capacity_bytes)} usable in all); no release can help"
    if f.feasible:
        return f"{head}: release {_releases_text(f.chosen)} to free {_g(f.freed)}"
    if f.possible:
        return f"{head}: short by {_g(f.shortfall - f.freed)}; waits for {_waiting_text(f.waited)}"
    return (f"{head}: short by {_g(f.need_bytes - f.reachable)} even if every reclaimable tenant were released; "
            f"in the way: {_in_the_way_text(f.blockers)}")


def plan_release(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
                 requester: str, need_bytes: int, *, promised: Mapping[str, int] | None = None,
                 mode: PlanMode = "request") -> Plan:
    """`promised`: tenant -> bytes admitted loads will still take from free memory (the requester's
    own load excluded by the caller). `mode`: "request" (a request that needs memory) or "relief"
    (the watchdog relieving a starved busy tenant: only tenants below it are candidates)."""
    f = decide(snap, registry, states, requester, need_bytes, promised=promised, mode=mode)
    return Plan(requester, need_bytes, f.free_bytes, f.held_bytes, f.feasible, f.starved, f.releases, f.blockers,
                explain(f), snap.estimated, f.possible, tuple(c.tenant.name for c in f.waited), f.promised_bytes,
                f.reachable)
