"""The handoff queue: the effects side of `arbiter.schedule`.

Requests that need memory wait here as `Waiter`s. One driver task (alive only while someone waits)
reads the card, asks the pure scheduler who runs, waits or is refused, and carries that out:
releases of idle tenants (one handoff at a time, under the handoff lock), reservations for the
admitted loads, a 507 for the impossible, a 503 with `Retry-After` past `proxy.queue_timeout_s`.

The plan runs again as soon as something that could change it happens (`kick()`: a request or a
job ended, a reservation settled, a waiter left) and, as a safety net, every `REPLAN_S` while
anyone waits. Every effect goes through `HandoffEffects`, so unit tests drive the queue with a
recording fake and an injected clock, without sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from proxy.clock import Clock
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.arbiter import Plan, TenantState, Verdict, Waiter, gib, unplanned_plan
from proxy.handoff.decisions import Decision, DecisionLog
from proxy.handoff.devices import schedule_on_devices
from proxy.tasks import sleep_or_wake
from proxy.tenants import Registry, Tenant

log = logging.getLogger("hyperswap.handoff")

REPLAN_S = 1.0  # safety net only: every change the proxy can see kicks the queue at once


@dataclass(slots=True)
class ReleaseResult:
    tenant: str
    expected_bytes: int
    freed_bytes: int
    duration_s: float
    confirmed: bool  # the card showed the memory back (invariant 6)
    error: str | None = None
    asked: dict[str, Any] = field(default_factory=dict)
    # Judged from the engines' own reports (no GPU reader): never `confirmed`, and `freed_bytes` is
    # what the engine says, not what the card shows. Ollama drops a model from /api/ps before its
    # memory is back.
    estimated: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "expected_bytes": self.expected_bytes, "freed_bytes": self.freed_bytes,
                "expected_gb": gib(self.expected_bytes), "freed_gb": gib(self.freed_bytes),
                "duration_s": round(self.duration_s, 3), "confirmed": self.confirmed, "estimated": self.estimated,
                "error": self.error, "asked": self.asked}


@dataclass(slots=True)
class Handoff:
    plan: Plan
    releases: list[ReleaseResult]
    decision: Decision | None
    snapshot: AttributedSnapshot | None = None
    reservation: str | None = None  # the key memory was reserved under; `Arbitration.settle` gives it back
    waited_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.plan.feasible and all(r.confirmed for r in self.releases)


Outcome = Literal["run", "refuse", "timeout"]


@dataclass(slots=True)
class Admitted:
    """What a waiting request got: run (forward it), refuse (507) or timeout (503)."""
    outcome: Outcome
    handoff: Handoff
    reason: str


class HandoffEffects(Protocol):
    """Everything the queue does to the world. `Arbitration` is the real one."""

    clock: Clock
    registry: Registry
    decisions: DecisionLog

    async def read(self) -> tuple[AttributedSnapshot, Mapping[str, TenantState], Mapping[str, tuple[str, int]]]:
        """The card, the tenants' busy states and the memory promised to admitted loads (by load key)."""

    async def carry_out(self, plan: Plan, snap: AttributedSnapshot, trigger: str, kind: str) -> Handoff:
        """Record the plan, release what it says under the handoff lock, wait for the memory."""

    def reserve(self, key: str, handoff: Handoff) -> None:
        """Promise the admitted load its memory until it reaches the card."""

    def abandon(self, handoff: Handoff) -> None:
        """An admitted request whose client left before using it: give back what was promised."""

    def prepare_load(self, tenant: str, model: str) -> None:
        """This load will run once memory is released or a busy tenant finishes: let its files be
        read into RAM meanwhile (warm-during-release). Must not block."""


@dataclass(slots=True, eq=False)
class _Ticket:
    waiter: Waiter
    trigger: str
    kind: str  # "plan" or "oom_retry": the decision kind if releases run
    future: asyncio.Future[Admitted]
    since_wall: float
    verdict: Verdict | None = None
    queued: Decision | None = None  # the "queued" decision, recorded when it first had to wait
    model: str | None = None  # what the load reads from disk, for `prepare_load`


class HandoffQueue:
    def __init__(self, effects: HandoffEffects) -> None:
        self.fx = effects
        self._ids = itertools.count(1)
        self._tickets: dict[int, _Ticket] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    # -- the request side ------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return not self._tickets

    def kick(self) -> None:
        """Something that can change a plan happened: run the scheduler again now."""
        if self._tickets:
            self._wake.set()

    async def request(self, tenant: Tenant, key: str, need_bytes: int, trigger: str, kind: str = "plan",
                      model: str | None = None) -> Admitted:
        """Wait for this load's turn. A client that leaves (its task cancelled) leaves the queue and
        gives back anything it was promised meanwhile."""
        clock = self.fx.clock
        w = Waiter(next(self._ids), tenant.name, key, need_bytes, tenant.priority, clock.now())
        ticket = _Ticket(w, trigger, kind, asyncio.get_running_loop().create_future(), clock.wall(), model=model)
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
            out.append({"id": t.waiter.id, "tenant": t.waiter.tenant, "trigger": t.trigger,
                        "since": round(t.since_wall, 3), "waited_s": round(now - t.waiter.arrived_at, 3),
                        "need_bytes": t.waiter.need_bytes, "need_gb": gib(t.waiter.need_bytes),
                        "priority": t.waiter.priority,
                        "waiting_for": list(v.plan.wait_for) if v else [],
                        "behind": v.behind if v else None,
                        "reason": v.reason if v and v.action == "wait" else "being planned"})
        return sorted(out, key=lambda d: d["id"])

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
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)

    async def _drive(self) -> None:
        try:
            while self._tickets:
                self._wake.clear()
                self._expire()
                if not self._tickets:
                    break
                snap, states, promised = await self.fx.read()
                if not self._tickets:
                    break
                if not snap.snapshot.device.size_known:
                    self._forward_unplanned(snap)
                    continue
                settings = self.fx.registry.config.proxy
                verdicts = schedule_on_devices(snap, self.fx.registry, states,
                                               [t.waiter for t in self._tickets.values()],
                                               promised, self.fx.clock.now(), settings.starvation_after_s)
                if await self._apply(verdicts, snap):
                    continue
                await sleep_or_wake(self.fx.clock, self._next_pause(), self._wake)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a waiter hanging on a broken pass
            log.exception("handoff queue failed")
            for ticket in list(self._tickets.values()):
                self._tickets.pop(ticket.waiter.id, None)
                if not ticket.future.done():
                    ticket.future.set_exception(exc)

    def _expire(self) -> None:
        timeout = self.fx.registry.config.proxy.queue_timeout_s
        now = self.fx.clock.now()
        for ticket in list(self._tickets.values()):
            if now - ticket.waiter.arrived_at >= timeout:
                plan = ticket.verdict.plan if ticket.verdict else None
                reason = (f"waited {timeout:g} s (proxy.queue_timeout_s): "
                          + (ticket.verdict.reason if ticket.verdict else "no plan could be made"))
                self._resolve(ticket, Admitted("timeout", Handoff(plan or _no_plan(ticket.waiter), [], None), reason))

    def _next_pause(self) -> float:
        timeout = self.fx.registry.config.proxy.queue_timeout_s
        now = self.fx.clock.now()
        first_deadline = min(t.waiter.arrived_at + timeout for t in self._tickets.values())
        starvation = self.fx.registry.config.proxy.starvation_after_s
        next_aging = min((t.waiter.arrived_at + starvation for t in self._tickets.values()
                          if t.waiter.arrived_at + starvation > now), default=now + REPLAN_S)
        return max(0.0, min(REPLAN_S, first_deadline - now, next_aging - now))

    async def _apply(self, verdicts: tuple[Verdict, ...], snap: AttributedSnapshot) -> bool:
        """Carry out one pass. True when anyone left the queue (the next pass sees a new state)."""
        progressed = False
        runs: list[tuple[_Ticket, Verdict]] = []
        for v in verdicts:
            ticket = self._tickets.get(v.waiter.id)
            if ticket is None:
                continue
            ticket.verdict = v
            if v.action == "refuse":
                decision = self.fx.decisions.record("rejection", v.waiter.tenant, ticket.trigger, v.plan.to_json(),
                                                    status=507, reason=v.reason)
                self._resolve(ticket, Admitted("refuse", Handoff(v.plan, [], decision, snap), v.reason))
                progressed = True
            elif v.action == "wait":
                self._note_wait(ticket, v)
            else:
                runs.append((ticket, v))
        releasing = next(((t, v) for t, v in runs if v.plan.releases), None)
        shared: Handoff | None = None
        if releasing is not None:
            ticket, v = releasing
            if ticket.model:  # the disk read overlaps the release instead of following it
                self.fx.prepare_load(v.waiter.tenant, ticket.model)
            shared = await self.fx.carry_out(v.plan, snap, ticket.trigger, ticket.kind)
        for ticket, v in runs:
            if self._tickets.get(v.waiter.id) is not ticket:
                continue  # left during the releases
            if shared is not None and v.plan.releases and v.waiter.key == releasing[1].waiter.key:  # type: ignore[index]
                handoff = Handoff(shared.plan, shared.releases, shared.decision, shared.snapshot)
            elif v.plan.releases:
                continue  # another load's releases ran in this pass; plan again with the memory back
            else:
                handoff = Handoff(v.plan, [], None, snap)
            self.fx.reserve(v.waiter.key, handoff)
            self._resolve(ticket, Admitted("run", handoff, v.reason))
            progressed = True
        return progressed or shared is not None

    def _forward_unplanned(self, snap: AttributedSnapshot) -> None:
        """Nothing to plan with (reader broken, no engine reports the card): forward, never block."""
        for ticket in list(self._tickets.values()):
            plan = unplanned_plan(ticket.waiter.tenant, ticket.waiter.need_bytes)  # what GET /api/plan says too
            self._resolve(ticket, Admitted("run", Handoff(plan, [], None, snap), plan.explanation))

    # -- bookkeeping -----------------------------------------------------------------------------
    def _resolve(self, ticket: _Ticket, admitted: Admitted) -> None:
        self._tickets.pop(ticket.waiter.id, None)
        admitted.handoff.waited_s = self.fx.clock.now() - ticket.waiter.arrived_at
        if ticket.queued is not None:
            ended = {"run": "admitted", "refuse": "refused (507)", "timeout": "timed out (503)"}[admitted.outcome]
            self.fx.decisions.update(ticket.queued, result=ended, waited_s=round(admitted.handoff.waited_s, 3),
                                     ended_by=admitted.handoff.decision.id if admitted.handoff.decision else None,
                                     ended_with=admitted.reason)
        if not ticket.future.done():
            ticket.future.set_result(admitted)
        elif admitted.outcome == "run":
            self.fx.abandon(admitted.handoff)  # its client left at this very moment

    def _note_wait(self, ticket: _Ticket, v: Verdict) -> None:
        if ticket.queued is None:
            if ticket.model:  # waiting for a busy tenant is time the disk can use
                self.fx.prepare_load(v.waiter.tenant, ticket.model)
            ticket.queued = self.fx.decisions.record("queued", v.waiter.tenant, ticket.trigger, v.plan.to_json(),
                                                     reason=v.reason, waiting_for=list(v.plan.wait_for), behind=v.behind)
        elif ticket.queued.outcome.get("reason") != v.reason:
            self.fx.decisions.update(ticket.queued, reason=v.reason, waiting_for=list(v.plan.wait_for), behind=v.behind)

    def _note_end(self, ticket: _Ticket, why: str) -> None:
        if ticket.queued is not None:
            self.fx.decisions.update(ticket.queued, result=why,
                                     waited_s=round(self.fx.clock.now() - ticket.waiter.arrived_at, 3))


def _no_plan(w: Waiter) -> Plan:
    return Plan(w.tenant, w.need_bytes, 0, 0, False, True, (), (), "no plan was made before the queue timeout", True)
