"""The queue's rules: who of the requests waiting for memory runs, waits or is refused, in queue
order (PURE: no I/O, no clock, invariant 1). Each waiter is planned with `plan.plan_release()`
against what the waiters ahead of it and the loads on their way already count on; batching (a load
on the card runs ahead of a swap away from it), the fairness bounds (`overtake_limit`,
`starvation_after_s`), one handoff at a time and the swap hold (`hold.py`) are decided here. The
scheduler (`scheduler.py`) carries the verdicts out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from proxy.config.registry import Registry
from proxy.config.settings import ProxySettings
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.hold import NO_HOLD, SwapHold
from proxy.handoff.plan import Plan, TenantState, plan_release

# Requests for what is on the card that may go ahead of one waiting to swap it away (tenants.json's
# proxy.overtake_limit); each saves a handoff, and the bound keeps the swap from waiting for ever.
DEFAULT_OVERTAKE_LIMIT = ProxySettings().overtake_limit


_HELD = re.compile(r"^holding the swap of (.+?) for ([\d.e+-]+) s \(proxy\.swap_hold_s")


def hold_reason(held: tuple[str, ...], hold_s: float) -> str:
    """A held swap's reason (`Verdict.reason`); `held_swap` reads it back."""
    return (f"holding the swap of {', '.join(held)} for {hold_s:.2g} s (proxy.swap_hold_s, weighed by its reload): "
            "requests for what is on the card go first")


def held_swap(reason: str) -> tuple[str, float] | None:
    """(the tenants kept, the hold's seconds) when a wait's reason is a held swap (`hold_reason`);
    None for any other wait. Where the reason is all that is kept (a decision's `reason`, the queue
    view), this tells a hold, a choice, apart from a wait for busy work."""
    match = _HELD.match(reason)
    return None if match is None else (match[1], float(match[2]))


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request that needs memory, waiting for its turn. `key` names the load: waiters with the
    same key (one tenant, one model) share one handoff and one reservation."""
    id: int
    tenant: str
    key: str
    need_bytes: int
    priority: int
    arrived_at: float
    resident: bool = False  # its load is on the card or on its way there: it needs no memory it does not have
    overtaken: int = 0  # requests for what is on the card that went ahead of it while it waited to swap it away
    waits_for: tuple[str, ...] = ()  # the tenants its last verdict waited for (whatever its place in the queue)


Action = Literal["run", "wait", "refuse"]


@dataclass(frozen=True, slots=True)
class Verdict:
    waiter: Waiter
    action: Action
    plan: Plan
    reason: str
    behind: int | None = None  # the waiter whose handoff or wait this one queues behind
    overtook: tuple[int, ...] = ()  # the waiters (waiting to swap its tenant away) a resident request went ahead of
    held: tuple[str, ...] = ()  # a swap held (`SwapHold`): the tenants it would release, whose resident work goes first
    held_until: float | None = None  # when that held swap starts at the latest (a pass is due then)

    @property
    def waiting_for(self) -> tuple[str, ...]:
        """The tenants it waits for: busy ones in the way, or those whose swap is held (it waits to see
        whether their requests follow)."""
        return self.plan.wait_for or self.held


def aged(w: Waiter, now: float, starvation_after_s: float) -> bool:
    return now - w.arrived_at >= starvation_after_s


def queue_order(waiters: Iterable[Waiter], now: float, starvation_after_s: float) -> list[Waiter]:
    """Higher priority first, then arrival. A waiter that has waited `starvation_after_s` goes ahead
    of everyone who has not (aged waiters among themselves by arrival), so later higher-priority
    arrivals can overtake a waiter for a bounded time only."""
    def rank(w: Waiter) -> tuple[int, int, float, int]:
        old = aged(w, now, starvation_after_s)
        return (0 if old else 1, 0 if old else -w.priority, w.arrived_at, w.id)
    return sorted(waiters, key=rank)


def may_overtake(w: Waiter, now: float, starvation_after_s: float, overtake_limit: int) -> bool:
    """Whether a request for what is on the card may still go ahead of `w`, a request waiting for
    that tenant to finish so its memory can be swapped away: batching saves a handoff per request
    it lets through, but only `overtake_limit` times and never once `w` has waited
    `starvation_after_s` (the fairness bound)."""
    return w.overtaken < overtake_limit and not aged(w, now, starvation_after_s)




def resident_plan(w: Waiter, fits: Plan | None = None) -> Plan:
    """What a request for a load already on the card (or on its way there) is admitted with: no
    release; `fits`, the plan that found room for its peak beside what its tenant holds (its
    figures are kept, so what the peak adds is reserved until the work ends)."""
    if fits is None:
        return Plan(w.tenant, w.need_bytes, 0, 0, True, False, (), (), f"{_RESIDENT_WHY}: forwarded without a plan", False)
    return resident_fit(fits)


def resident_fit(fits: Plan) -> Plan:
    """A resident request's plan from the plan that found room for its peak (figures kept)."""
    return replace(fits, explanation=f"{_RESIDENT_WHY}: {fits.explanation}")


_RESIDENT_WHY = "on the card already, room for its peak"
RoomyKey = tuple[str, int, tuple[tuple[str, int], ...]]  # requester, peak, promises (tenant -> bytes), sorted


class RoomyPlans:
    """The resident plans (`resident_plan`) of at-once admissions on the latest card reading, by
    requester, peak and promises. Such a plan had room for the peak with no release, so it read
    nothing but the reading and the promises: no busy state (`plan.decide` looks at them, and at the
    tenants' settings, only when short, and a short plan is never chosen over one with room), no
    clock. On the same reading (readings are frozen: a new one is a new object) with the same
    promises it is the same plan. Forgotten when the reading or the registry changes."""

    MAX = 64  # peaks and promise sets kept per reading

    def __init__(self) -> None:
        self._snap: AttributedSnapshot | None = None
        self._registry: Registry | None = None
        self._plans: dict[RoomyKey, Plan] = {}

    def find(self, snap: AttributedSnapshot, registry: Registry, key: RoomyKey) -> Plan | None:
        # the registry too: a reload (a tenant moved to another card) is a new object, planned afresh
        if snap is not self._snap or registry is not self._registry:
            self._snap, self._registry, self._plans = snap, registry, {}
            return None
        return self._plans.get(key)

    def keep(self, snap: AttributedSnapshot, registry: Registry, key: RoomyKey, plan: Plan) -> None:
        if snap is self._snap and registry is self._registry and len(self._plans) < self.MAX:
            self._plans[key] = plan


RESIDENT = "resident"  # the reason of a resident admission: its load is on the card, nothing to time


def promised_by_tenant(claims: Mapping[str, tuple[str, int]], key: str) -> dict[str, int]:
    """Load key -> (tenant, bytes) summed per tenant, leaving out the load `key` itself."""
    out: dict[str, int] = defaultdict(int)
    for k, (tenant, n) in claims.items():
        if k != key and n > 0:
            out[tenant] += n
    return dict(out)


def _claim(claims: dict[str, tuple[str, int]], w: Waiter, plan: Plan) -> None:
    n = max(0, w.need_bytes - plan.held_by_requester)
    old = claims.get(w.key)
    claims[w.key] = (w.tenant, max(n, old[1] if old else 0))


@dataclass(frozen=True, slots=True)
class Releasing:
    """A release under way (the queue's own handoff, or one the watchdog or the admin API started):
    the scheduler's state between passes, since it never waits for a release to end."""
    tenants: tuple[str, ...]  # being released: their memory is spoken for, their new work waits
    key: str | None = None  # the load it makes room for; waiters of that load join it (None: no load)
    waiter: int | None = None  # the waiter it was started for, for `Verdict.behind`
    requester: str = ""  # whose load it makes room for ("" for the watchdog's and the admin's)


def schedule(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
             waiters: Iterable[Waiter], promised: Mapping[str, tuple[str, int]], now: float,
             starvation_after_s: float, releasing: Sequence[Releasing] = (),
             overtake_limit: int = DEFAULT_OVERTAKE_LIMIT, hold: SwapHold = NO_HOLD,
             room: Mapping[str, int] | None = None) -> tuple[Verdict, ...]:
    """Who runs, who waits, who is refused, in queue order.

    `promised`: load key -> (tenant, bytes) still to reach the card for loads already admitted.
    - impossible (even after every busy tenant finished): refuse at once.
    - a waiter's tenant that a waiter ahead waits for starts no new work: it queues behind (so the
      one ahead is never overtaken by the very work that keeps it waiting).
    - feasible now: run. One set of releases at a time (`releasing`: those under way, each pass
      starts at most one more only when none is); waiters of the same load key join it; the others
      wait for a pass that sees the memory back. Work that needs no release runs meanwhile.
    - a waiter whose own tenant is being released for another load waits for that release to end
      (the memory is promised to that load: new work would take it back under the release). A
      release with no load behind it (the watchdog's idle release, the admin's) holds back no work.
    - a resident waiter (its load on the card or on its way) whose peak fits beside what its tenant
      holds needs no release: it runs, even ahead of waiters that wait for its tenant to finish
      (batching: one swap for the whole burst), as long as each of them `may_overtake` and its
      engine runs it at once (`room`: tenant -> how many more its engine runs at once; while someone
      waits for that tenant, no more are admitted, so this queue orders them, not the engine's); past
      that it queues behind them like other work. A resident peak that does not fit is planned like
      any load (a render on a resident checkpoint still samples).
    - a feasible swap away from a tenant active lately is held (`hold.until`, proxy/handoff/hold.py):
      it waits, and the tenants it would release count as waited for (their resident work runs ahead
      of it, counted against the fairness bound; their other work queues behind it).
    - otherwise wait; what it counts on is claimed so that no later waiter takes it meanwhile.
    """
    return _Pass(snap, registry, dict(states), dict(promised), now, starvation_after_s, releasing, overtake_limit,
                 hold, dict(room or {}), dict(promised)).run(waiters)


@dataclass(slots=True)
class _Pass:
    """One `schedule()` pass: its inputs and what earlier waiters in queue order left for later ones."""
    snap: AttributedSnapshot
    registry: Registry
    states: dict[str, TenantState]  # tenants given work in this pass count as busy for the waiters after it
    claims: dict[str, tuple[str, int]]  # load key -> (tenant, bytes): admitted loads' and earlier waiters' claims
    now: float
    starvation_after_s: float
    releasing: Sequence[Releasing]
    overtake_limit: int
    hold: SwapHold
    room: dict[str, int]  # tenant -> how many more its engine runs at once (absent: no bound); used up as they run
    # `claims` less what waiters count on: what resident work is measured against (a waiter that waits
    # for a tenant counts on memory that tenant's running work gives back before the waiter can run)
    granted: dict[str, tuple[str, int]]
    holding_back: dict[str, list[Waiter]] = field(default_factory=dict)  # tenant -> waiters ahead that wait for it
    waited_for: dict[str, list[Waiter]] = field(default_factory=dict)  # tenant -> waiters its last pass made wait for it
    starting: Waiter | None = None  # the waiter whose releases this pass starts
    swapped: set[str] = field(default_factory=set)  # tenants this pass starts releasing: their new work waits
    claimers: list[Waiter] = field(default_factory=list)  # waiters ahead that run or count on memory
    out: list[Verdict] = field(default_factory=list)

    def run(self, waiters: Iterable[Waiter]) -> tuple[Verdict, ...]:
        ordered = queue_order(waiters, self.now, self.starvation_after_s)
        for w in ordered:  # the bounds hold whatever the priorities: a waiter behind in the queue counts too
            for t in w.waits_for:
                if t != w.tenant:
                    self.waited_for.setdefault(t, []).append(w)
        for w in ordered:
            self._decide(w)
        return tuple(self.out)

    def _may_overtake(self, w: Waiter) -> bool:
        return may_overtake(w, self.now, self.starvation_after_s, self.overtake_limit)

    def _wait(self, w: Waiter, plan: Plan, reason: str, behind: int | None = None, *, claimer: bool = False) -> None:
        self.out.append(Verdict(w, "wait", plan, reason, behind))
        _claim(self.claims, w, plan)
        if claimer:
            self.claimers.append(w)

    def _own_release(self, w: Waiter) -> Releasing | None:
        """The release under way of `w`'s own tenant for another load (its memory is promised there)."""
        return next((r for r in self.releasing if r.key is not None and w.tenant in r.tenants), None)

    def _resident_runs(self, w: Waiter, own: Releasing | None, crowd: list[Waiter]) -> bool:
        """A load on the card (or on its way) whose peak fits beside what is admitted (waiters' claims
        aside: those waiting for its tenant count on memory its work gives back first) runs ahead of
        those waiting to swap its tenant away (`crowd`), within the fairness bound and what its engine
        runs at once, unless its tenant is being released."""
        if not w.resident or own is not None or w.tenant in self.swapped:
            return False
        plan = plan_release(self.snap, self.registry, self.states, w.tenant, w.need_bytes,
                            promised=promised_by_tenant(self.granted, w.key))
        if not plan.feasible or plan.releases:
            return False
        if crowd and not self._may_go_ahead(w, crowd):
            return False
        self._take_room(w)
        self.out.append(Verdict(w, "run", resident_plan(w, plan), RESIDENT, overtook=tuple(a.id for a in crowd)))
        self._grant(w, plan)
        return True

    def _decide(self, w: Waiter) -> None:
        own = self._own_release(w)
        waiting_for_it = self.holding_back.get(w.tenant, [])
        # every waiter that waits for this tenant, ahead in the queue or not: the fairness bound and what
        # its engine runs at once hold whatever the priorities
        crowd = [*waiting_for_it, *(a for a in self.waited_for.get(w.tenant, []) if a not in waiting_for_it)]
        if self._resident_runs(w, own, crowd):
            return
        plan = plan_release(self.snap, self.registry, self.states, w.tenant, w.need_bytes,
                            promised=promised_by_tenant(self.claims, w.key))
        if not plan.possible:
            self.out.append(Verdict(w, "refuse", plan, plan.explanation))
        elif own is not None or w.tenant in self.swapped:
            behind = own.waiter if own is not None else self.starting.id if self.starting is not None else None
            self._wait(w, plan, f"queued behind the release of {w.tenant} in progress", behind)
        elif waiting_for_it:
            ahead = waiting_for_it[0]
            self._wait(w, plan, f"queued behind a {ahead.tenant} request (priority {ahead.priority}) "
                                f"that waits for {w.tenant} to finish", ahead.id)
        elif crowd and not self._may_go_ahead(w, crowd):
            first = crowd[0]
            self._wait(w, plan, f"queued behind a {first.tenant} request (priority {first.priority}) that waits for "
                                f"{w.tenant} to finish: {w.tenant} already runs what it runs at once, or that "
                                "request was overtaken as often as the fairness bound allows", first.id)
        elif plan.feasible and plan.releases and self._swap_waits(w, plan):
            return
        elif plan.feasible:
            self._runs(w, plan, crowd)
        else:
            self._wait_for_memory(w, plan)

    def _runs(self, w: Waiter, plan: Plan, crowd: list[Waiter]) -> None:
        """`w` runs now (after its releases, which this pass starts when no other does)."""
        if plan.releases and self.starting is None:
            self.starting = w
        self.swapped.update(r.tenant for r in plan.releases)
        self._take_room(w)
        self.out.append(Verdict(w, "run", plan, plan.explanation, overtook=tuple(a.id for a in crowd)))
        self._grant(w, plan)
        self.claimers.append(w)

    def _grant(self, w: Waiter, plan: Plan) -> None:
        """`w` runs: what it takes is claimed for the waiters after it, resident ones included."""
        _claim(self.claims, w, plan)
        _claim(self.granted, w, plan)

    def _may_go_ahead(self, w: Waiter, crowd: list[Waiter]) -> bool:
        """Whether work of `w`'s tenant may still go ahead of `crowd`, the waiters that wait for that
        tenant to finish: each within the fairness bound, and its engine not running all it runs at
        once already (more would only queue inside the engine, out of this queue's order)."""
        return all(self._may_overtake(a) for a in crowd) and self.room.get(w.tenant, 1) > 0

    def _take_room(self, w: Waiter) -> None:
        """`w` runs: one less its engine runs at once, and its tenant has work from now on (no later
        waiter in this pass plans to release it)."""
        if w.tenant in self.room:
            self.room[w.tenant] -= 1
        old = self.states.get(w.tenant)
        if old is None or not old.busy:
            self.states[w.tenant] = TenantState(w.tenant, True, "a request admitted in this pass", 1)

    def _swap_waits(self, w: Waiter, plan: Plan) -> bool:
        """A feasible swap that must wait: behind another release or handoff, or held (`hold.until`).
        False: it may start in this pass."""
        joined = next((r for r in self.releasing if r.key is not None and r.key == w.key), None)
        other = next((r for r in self.releasing if r is not joined), None)
        if other is not None and joined is None:
            self._wait(w, plan, _behind_release(other), other.waiter)
            return True
        if self.starting is not None and self.starting.key != w.key:
            self._wait(w, plan, f"queued behind the handoff to {self.starting.tenant} in progress", self.starting.id)
            return True
        until = None if joined is not None else self.hold.until(w.arrived_at, plan.releases)
        if until is None or self.now >= until or not self._may_overtake(w):
            return False
        held = tuple(r.tenant for r in plan.releases)
        for t in held:
            self.holding_back.setdefault(t, []).append(w)
        self.out.append(Verdict(w, "wait", plan, hold_reason(held, until - w.arrived_at), held=held, held_until=until))
        _claim(self.claims, w, plan)
        self.claimers.append(w)
        return True

    def _wait_for_memory(self, w: Waiter, plan: Plan) -> None:
        """Not feasible now: wait for the busy tenants in the way, or for memory claimed ahead."""
        for t in plan.wait_for:
            self.holding_back.setdefault(t, []).append(w)
        busy = ", ".join(f"{t} ({self.states[t].busy_reason})" if t in self.states else t for t in plan.wait_for)
        first = self.claimers[0] if self.claimers else None
        if busy:
            self._wait(w, plan, f"queued behind {busy}", claimer=True)
        elif first is not None:
            self._wait(w, plan, f"queued behind a {first.tenant} request that counts on the same memory", first.id,
                       claimer=True)
        else:
            self._wait(w, plan, "queued until loads already admitted reach the card", claimer=True)


def _behind_release(r: Releasing) -> str:
    if r.requester:
        return f"queued behind the handoff to {r.requester} in progress"
    return f"queued behind the release of {', '.join(r.tenants)} in progress"
