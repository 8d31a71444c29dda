"""The handoff scheduler: the effects side of `arbiter.schedule`, and the one owner of what is under way.

Requests that need memory wait here as `Waiter`s. One driver task (alive only while someone waits)
reads the card, asks the pure scheduler who runs, waits or is refused, and carries that out
without ever awaiting an effect: a release runs as a task of its own that reports back when the
card shows the memory (or its timeout says it failed), the way llama-swap's scheduler starts a
swap and hears `OnSwapDone`. Meanwhile the driver goes on planning, so work that needs no release
(a model already on the card, a load that fits) is admitted in the same pass. "One handoff at a
time" is state here (`Releasing`, handed to every pass), not a lock the driver waits on.

Every release, the queue's own, the watchdog's and the admin API's, goes through `release()`: it
marks the tenants as being released, runs the effect, records the decision, and always wakes the
queue when it ends.

The plan runs again as soon as something that could change it happens (`kick()`: a request or a
job ended, a reservation settled, a release ended, a waiter left). While anyone waits the card is
also read again every `REPLAN_S`: memory that comes back outside the proxy (a process exiting, an
admitted load reaching the card, an engine's own unload) sends no event. Every effect goes through
`HandoffEffects`, so unit tests drive the queue with a recording fake and an injected clock,
without sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from proxy.clock import Clock
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.visibility import held_by_device
from proxy.handoff.arbiter import (
    RESIDENT,
    Plan,
    Release,
    Releasing,
    TenantState,
    Verdict,
    Waiter,
    gib,
    may_overtake,
    resident_plan,
    unplanned_plan,
)
from proxy.handoff.decisions import (
    DecisionLog,
    HandoffKind,
    HandoffStarted,
    Queued,
    QueueEnd,
    QueueEnded,
    Rejected,
    ReleaseResult,
    WaitChanged,
)
from proxy.handoff.devices import schedule_on_devices
from proxy.handoff.inflight import Token
from proxy.tasks import sleep_or_wake
from proxy.tenants import Registry, Tenant

log = logging.getLogger("hyperswap.handoff")

REPLAN_S = 1.0  # the card is read again this often while anyone waits: memory freed outside the proxy sends no event


@dataclass(slots=True)
class Handoff:
    plan: Plan
    releases: list[ReleaseResult]
    decision: HandoffStarted | Rejected | None  # the handoff that made room for it, or its 507
    snapshot: AttributedSnapshot | None = None
    reservation: str | None = None  # the key memory was reserved under; `Arbitration.settle` gives it back
    waited_s: float = 0.0
    queued: int | None = None  # the request's `queued` decision, when it had to wait



Outcome = Literal["run", "refuse", "timeout"]
_QUEUE_END: dict[Outcome, QueueEnd] = {"run": "admitted", "refuse": "refused (507)", "timeout": "timed out (503)"}


@dataclass(slots=True)
class Admitted:
    """What a waiting request got: run (forward it), refuse (507) or timeout (503)."""
    outcome: Outcome
    handoff: Handoff
    reason: str


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


class HandoffEffects(Protocol):
    """Everything the queue does to the world. `Arbitration` is the real one."""

    clock: Clock
    registry: Registry
    decisions: DecisionLog

    async def read(self) -> tuple[AttributedSnapshot, Mapping[str, TenantState], Mapping[str, tuple[str, int]]]:
        """The card, the tenants' busy states and the memory promised to admitted loads (by load key)."""

    async def carry_out(self, order: ReleaseOrder) -> Released:
        """Record the order, release what it says under the handoff lock (never a tenant that is
        busy by then), wait for the memory. Run by `HandoffQueue.release` as a task, never awaited
        by the driver."""

    def reserve(self, key: str, handoff: Handoff) -> None:
        """Promise the admitted load its memory until it reaches the card."""

    def abandon(self, handoff: Handoff) -> None:
        """An admitted request whose client left before using it: give back what was promised."""

    def prepare_load(self, tenant: str, model: str) -> None:
        """This load will run once memory is released or a busy tenant finishes: let its files be
        read into RAM meanwhile (warm-during-release). Must not block."""

    def admit_work(self, work: Token) -> None:
        """The request was admitted: from now on it is its tenant's work (never while it waited)."""

    def resident(self, tenant: str, key: str) -> bool:
        """This load is on the card already, or on its way there (admitted, not arrived yet)."""


@dataclass(slots=True, eq=False)
class _Ticket:
    waiter: Waiter
    trigger: str
    kind: HandoffKind  # "plan" or "oom_retry": the decision kind if releases run
    future: asyncio.Future[Admitted]
    since_wall: float
    verdict: Verdict | None = None
    queued: Queued | None = None  # emitted when it first had to wait
    wait_reason: str = ""  # what the last `Queued` or `WaitChanged` said it waits for
    model: str | None = None  # what the load reads from disk, for `prepare_load`
    joined: _Underway | None = None  # the release it waits on: admitted when that reports back
    work: Token | None = None  # the request's traffic token: work from its admission on, never before
    overtaken: int = 0  # resident requests that went ahead of it while it waited to swap their tenant away


@dataclass(slots=True, eq=False)
class _Underway:
    """A release running as a task: what the next passes must leave alone, and who waits on it."""
    state: Releasing
    order: ReleaseOrder
    task: asyncio.Task[Released]

    @property
    def claim(self) -> tuple[str, int] | None:
        """What the load it makes room for will take from memory that is free now (the rest comes
        from the release): promised to it, so no later waiter takes it meanwhile."""
        plan = self.order.plan
        if plan is None or self.state.key is None:
            return None
        return plan.requester, max(0, plan.need_bytes - plan.held_by_requester - plan.expected_free_bytes)


class HandoffQueue:
    """The scheduler: one owner of the waiting requests and the releases under way."""

    def __init__(self, effects: HandoffEffects) -> None:
        self.fx = effects
        self._ids = itertools.count(1)
        self._tickets: dict[int, _Ticket] = {}
        self._underway: list[_Underway] = []
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    # -- the request side ------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return not self._tickets

    @property
    def releasing(self) -> tuple[Releasing, ...]:
        """The releases under way, whoever started them."""
        return tuple(u.state for u in self._underway)

    def kick(self) -> None:
        """Something that can change a plan happened: run the scheduler again now."""
        if self._tickets:
            self._wake.set()

    def admit_at_once(self, tenant: Tenant, key: str, need_bytes: int, work: Token | None = None) -> Admitted | None:
        """The scheduler's first step for a request, taken without reading the card: a load that is on
        the card already (or on its way there) runs now, ahead of requests that wait to swap its
        tenant away, within the fairness bound (`arbiter.may_overtake`). None: it goes through
        `request` (its tenant is being swapped away, a waiter may not be overtaken any more, or a
        waiter not planned yet may be one that waits for it)."""
        if not self.fx.resident(tenant.name, key):
            return None
        if any(tenant.name in u.state.tenants for u in self._underway if u.state.key is not None):
            return None  # its memory is promised to another load: the release must not be undone
        blocking: list[_Ticket] = []
        for t in self._tickets.values():
            if t.joined is not None:
                continue
            if t.verdict is None:
                return None  # a waiter the scheduler has not seen yet: let the next pass order both
            if t.verdict.action == "wait" and tenant.name in t.verdict.plan.wait_for:
                blocking.append(t)
        settings = self.fx.registry.config.proxy
        now = self.fx.clock.now()
        if not all(may_overtake(self._waiter(t), now, settings.starvation_after_s, settings.overtake_limit)
                   for t in blocking):
            return None
        for t in blocking:
            t.overtaken += 1
        w = Waiter(next(self._ids), tenant.name, key, need_bytes, tenant.priority, now, resident=True)
        if work is not None:
            self.fx.admit_work(work)
        return Admitted("run", Handoff(resident_plan(w), [], None), RESIDENT)

    async def request(self, tenant: Tenant, key: str, need_bytes: int, trigger: str, kind: HandoffKind = "plan",
                      model: str | None = None, work: Token | None = None) -> Admitted:
        """Wait for this load's turn. `work`: the request's traffic token, admitted (counted as the
        tenant's work) in the same step that admits the request, never while it waits. A client that
        leaves (its task cancelled) leaves the queue and gives back anything it was promised
        meanwhile; a release started for it runs to its end."""
        clock = self.fx.clock
        w = Waiter(next(self._ids), tenant.name, key, need_bytes, tenant.priority, clock.now())
        ticket = _Ticket(w, trigger, kind, asyncio.get_running_loop().create_future(), clock.wall(), model=model,
                         work=work)
        self._tickets[w.id] = ticket
        self._start_driver()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if self._tickets.pop(w.id, None) is not None:
                self._note_end(ticket, "client left while waiting")
                self.kick()
            if ticket.future.done() and not ticket.future.cancelled():
                self.fx.abandon(ticket.future.result().handoff)
            raise

    def waiting(self) -> list[dict[str, Any]]:
        """Each waiting request, for people: tenant, since when, waiting for whom and why."""
        now = self.fx.clock.now()
        out = []
        for t in self._tickets.values():
            v = t.verdict
            if t.joined is not None:
                reason = f"releasing {', '.join(t.joined.state.tenants)} for it"
            else:
                reason = v.reason if v and v.action == "wait" else "being planned"
            out.append({"id": t.waiter.id, "tenant": t.waiter.tenant, "trigger": t.trigger,
                        "since": round(t.since_wall, 3), "waited_s": round(now - t.waiter.arrived_at, 3),
                        "need_bytes": t.waiter.need_bytes, "need_gb": gib(t.waiter.need_bytes),
                        "priority": t.waiter.priority,
                        "waiting_for": list(v.plan.wait_for) if v and t.joined is None else [],
                        "behind": v.behind if v and t.joined is None else None,
                        "reason": reason})
        return sorted(out, key=lambda d: d["id"])

    # -- the one release path --------------------------------------------------------------------
    def release(self, order: ReleaseOrder, *, key: str | None = None, waiter: int | None = None) -> asyncio.Task[Released]:
        """Start a release as a task and return at once. Its tenants count as being released until
        it ends (their new work waits, no other plan takes their memory); when it ends the waiters
        that joined it are admitted and the queue is woken. Callers other than the driver (the
        watchdog, the admin API) may await the task, shielded (a caller that goes away must not cut a
        release half way): the driver never awaits it."""
        return self._start_release(order, key, waiter).task

    def _start_release(self, order: ReleaseOrder, key: str | None, waiter: int | None) -> _Underway:
        state = Releasing(tuple(r.tenant for r in order.releases), key, waiter,
                          order.requester if key is not None else "")
        task = asyncio.create_task(self.fx.carry_out(order), name=f"hyperswap:release:{','.join(state.tenants)}")
        underway = _Underway(state, order, task)
        self._underway.append(underway)
        task.add_done_callback(lambda t: self._release_done(underway, t))
        return underway

    def _release_done(self, underway: _Underway, task: asyncio.Task[Released]) -> None:
        """OnSwapDone: the release ended (or failed); admit whoever joined it, plan the rest again."""
        if underway in self._underway:
            self._underway.remove(underway)
        joined = [t for t in self._tickets.values() if t.joined is underway]
        if task.cancelled():
            for ticket in joined:
                self._tickets.pop(ticket.waiter.id, None)
                ticket.future.cancel()
        elif (exc := task.exception()) is not None:
            log.error("release of %s failed", ", ".join(underway.state.tenants), exc_info=exc)
            for ticket in joined:
                self._tickets.pop(ticket.waiter.id, None)
                if not ticket.future.done():
                    ticket.future.set_exception(exc)
        elif any(r.busy for r in task.result().results):
            for ticket in joined:  # a tenant it counted on had work again: plan them again
                ticket.joined = None
        else:
            released = task.result()
            plan = underway.order.plan
            for ticket in joined:
                handoff = Handoff(plan or _no_plan(ticket.waiter), released.results, released.decision,
                                  underway.order.snapshot)
                self.fx.reserve(ticket.waiter.key, handoff)
                reason = ticket.verdict.reason if ticket.verdict else (plan.explanation if plan else "released")
                self._resolve(ticket, Admitted("run", handoff, reason))
        self._wake.set()
        if self._tickets:
            self._start_driver()

    # -- the driver ------------------------------------------------------------------------------
    def _start_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive(), name="hyperswap:handoff-queue")
        self._wake.set()

    async def aclose(self) -> None:
        for ticket in list(self._tickets.values()):
            if not ticket.future.done():
                ticket.future.cancel()
        self._tickets.clear()
        tasks: list[asyncio.Task[Any]] = [u.task for u in self._underway]
        if self._driver is not None:
            tasks.append(self._driver)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _planned(self) -> list[_Ticket]:
        """The tickets each pass plans for: those not already waiting on a release under way."""
        return [t for t in self._tickets.values() if t.joined is None]

    def _waiter(self, ticket: _Ticket) -> Waiter:
        """The ticket as the pure scheduler sees it now: whether its load is resident (an OOM retry
        never is: what is on the card was not enough) and how often it was overtaken so far."""
        w = ticket.waiter
        resident = ticket.kind != "oom_retry" and self.fx.resident(w.tenant, w.key)
        return replace(w, resident=resident, overtaken=ticket.overtaken)

    async def _drive(self) -> None:
        try:
            while self._tickets:
                self._wake.clear()
                self._expire()
                if not self._planned():
                    if not self._tickets:
                        break
                    await self._wake.wait()  # only waiters of releases under way: they report back
                    continue
                snap, states, promised = await self.fx.read()
                pending = self._planned()
                if not pending:
                    continue
                if not snap.snapshot.device.size_known:
                    self._forward_unplanned(snap, pending)
                    continue
                claims = dict(promised)
                for u in self._underway:
                    if (claim := u.claim) is not None and u.state.key is not None:
                        claims[u.state.key] = claim
                settings = self.fx.registry.config.proxy
                verdicts = schedule_on_devices(snap, self.fx.registry, states, [self._waiter(t) for t in pending],
                                               claims, self.fx.clock.now(), settings.starvation_after_s,
                                               self.releasing, settings.overtake_limit)
                if self._apply(verdicts, snap):
                    continue
                await sleep_or_wake(self.fx.clock, self._next_pause(), self._wake)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a waiter hanging on a broken pass
            log.exception("handoff queue failed")
            for ticket in self._planned():
                self._tickets.pop(ticket.waiter.id, None)
                if not ticket.future.done():
                    ticket.future.set_exception(exc)

    def _expire(self) -> None:
        """Past `proxy.queue_timeout_s`: 503. A waiter whose release is under way is not cut off:
        the release has a timeout of its own, and its memory is coming."""
        timeout = self.fx.registry.config.proxy.queue_timeout_s
        now = self.fx.clock.now()
        for ticket in self._planned():
            if now - ticket.waiter.arrived_at >= timeout:
                plan = ticket.verdict.plan if ticket.verdict else None
                why = ticket.verdict.reason if ticket.verdict else "no plan could be made"
                self._resolve(ticket, Admitted("timeout", Handoff(plan or _no_plan(ticket.waiter), [], None), why))

    def _next_pause(self) -> float:
        timeout = self.fx.registry.config.proxy.queue_timeout_s
        now = self.fx.clock.now()
        planned = self._planned()
        first_deadline = min((t.waiter.arrived_at + timeout for t in planned), default=now + REPLAN_S)
        starvation = self.fx.registry.config.proxy.starvation_after_s
        next_aging = min((t.waiter.arrived_at + starvation for t in planned
                          if t.waiter.arrived_at + starvation > now), default=now + REPLAN_S)
        return max(0.0, min(REPLAN_S, first_deadline - now, next_aging - now))

    def _apply(self, verdicts: tuple[Verdict, ...], snap: AttributedSnapshot) -> bool:
        """Carry out one pass, awaiting nothing. True when anyone left the queue (the next pass
        sees a new state)."""
        progressed = False
        for v in verdicts:
            ticket = self._tickets.get(v.waiter.id)
            if ticket is None:
                continue
            ticket.verdict = v
            for overtaken in v.overtook:
                if (behind := self._tickets.get(overtaken)) is not None:
                    behind.overtaken += 1
            if v.action == "refuse":
                decision = self.fx.decisions.emit(Rejected(tenant=v.waiter.tenant, trigger=ticket.trigger, plan=v.plan,
                                                           status=507, reason=v.reason))
                self._resolve(ticket, Admitted("refuse", Handoff(v.plan, [], decision, snap), v.reason))
                progressed = True
            elif v.action == "wait":
                self._note_wait(ticket, v)
            elif v.plan.releases:
                self._join_or_start(ticket, v, snap)
            elif v.reason == RESIDENT:  # on the card already: its memory is held or reserved, nothing to promise
                self._resolve(ticket, Admitted("run", Handoff(v.plan, [], None, snap), v.reason))
                progressed = True
            else:
                handoff = Handoff(v.plan, [], None, snap)
                self.fx.reserve(v.waiter.key, handoff)
                self._resolve(ticket, Admitted("run", handoff, v.reason))
                progressed = True
        return progressed

    def _join_or_start(self, ticket: _Ticket, v: Verdict, snap: AttributedSnapshot) -> None:
        """A load that runs once its releases are done: join the release under way for the same load,
        or start one (the pure scheduler lets at most one start while none is under way)."""
        underway = next((u for u in self._underway if u.state.key == v.waiter.key), None)
        if underway is None:
            if ticket.model:  # the disk read overlaps the release instead of following it
                self.fx.prepare_load(v.waiter.tenant, ticket.model)
            order = ReleaseOrder(v.waiter.tenant, v.plan.releases, ticket.trigger, ticket.kind, v.plan, snap)
            underway = self._start_release(order, v.waiter.key, v.waiter.id)
        ticket.joined = underway

    def _forward_unplanned(self, snap: AttributedSnapshot, pending: list[_Ticket]) -> None:
        """Nothing to plan with (reader broken, no engine reports the card): forward, never block."""
        for ticket in pending:
            plan = unplanned_plan(ticket.waiter.tenant, ticket.waiter.need_bytes)  # what GET /api/plan says too
            self._resolve(ticket, Admitted("run", Handoff(plan, [], None, snap), plan.explanation))

    # -- bookkeeping -----------------------------------------------------------------------------
    def _resolve(self, ticket: _Ticket, admitted: Admitted) -> None:
        self._tickets.pop(ticket.waiter.id, None)
        admitted.handoff.waited_s = self.fx.clock.now() - ticket.waiter.arrived_at
        if ticket.queued is not None:
            admitted.handoff.queued = ticket.queued.id
            ended = _QUEUE_END[admitted.outcome]
            by = admitted.handoff.decision
            self.fx.decisions.emit(QueueEnded(tenant=ticket.queued.tenant, trigger=ticket.trigger, refers_to=ticket.queued.id,
                                              result=ended, waited_s=admitted.handoff.waited_s,
                                              ended_by=by.id if by is not None else None, ended_with=admitted.reason))
        if not ticket.future.done():
            if admitted.outcome == "run" and ticket.work is not None:
                self.fx.admit_work(ticket.work)  # work from this step on: no pass sees it idle in between
            ticket.future.set_result(admitted)
        elif admitted.outcome == "run":
            self.fx.abandon(admitted.handoff)  # its client left at this very moment

    def _note_wait(self, ticket: _Ticket, v: Verdict) -> None:
        if ticket.queued is None:
            if ticket.model:  # waiting for a busy tenant is time the disk can use
                self.fx.prepare_load(v.waiter.tenant, ticket.model)
            ticket.queued = self.fx.decisions.emit(Queued(tenant=v.waiter.tenant, trigger=ticket.trigger, plan=v.plan,
                                                          reason=v.reason, behind=v.behind))
        elif ticket.wait_reason != v.reason:
            self.fx.decisions.emit(WaitChanged(tenant=v.waiter.tenant, trigger=ticket.trigger, refers_to=ticket.queued.id,
                                               reason=v.reason, waiting_for=v.plan.wait_for, behind=v.behind))
        ticket.wait_reason = v.reason

    def _note_end(self, ticket: _Ticket, why: QueueEnd) -> None:
        if ticket.queued is not None:
            self.fx.decisions.emit(QueueEnded(tenant=ticket.queued.tenant, trigger=ticket.trigger,
                                              refers_to=ticket.queued.id, result=why,
                                              waited_s=self.fx.clock.now() - ticket.waiter.arrived_at))


def release_whole(snap: AttributedSnapshot, tenant: Tenant, trigger: str, kind: HandoffKind, why: str,
                  idle_s: float | None = None) -> ReleaseOrder:
    """An order to release all a tenant holds above its idle floor, for no load in particular (the
    watchdog's idle release, the admin API's release)."""
    held = snap.held_by(tenant.name)
    pids = tuple(p.process.pid for p in snap.processes if p.tenant == tenant.name)
    release = Release(tenant.name, max(0, held - tenant.idle_vram_bytes), pids, why)
    by_device = held_by_device(snap, tenant.name) if snap.snapshot.several_devices else {}
    return ReleaseOrder(tenant.name, (release,), trigger, kind, None, snap, held, by_device, idle_s)


def stop_whole(snap: AttributedSnapshot, tenant: Tenant, trigger: str, why: str) -> ReleaseOrder:
    """An order to stop a tenant the proxy starts (the admin API's stop): a release through its
    stopping step alone (soft steps before it skipped), so all it holds goes, its idle floor too."""
    held = snap.held_by(tenant.name)
    pids = tuple(p.process.pid for p in snap.processes if p.tenant == tenant.name)
    release = Release(tenant.name, held, pids, why)
    return ReleaseOrder(tenant.name, (release,), trigger, "release", None, snap, held_bytes=held, stop=True)


def _no_plan(w: Waiter) -> Plan:
    return Plan(w.tenant, w.need_bytes, 0, 0, False, True, (), (), "no plan was made before the queue timeout", True)
