"""The scheduler: the one owner of admission state, and the effects side of `policy.schedule`.

It holds every piece of state that decides who runs: the requests waiting for memory (`Waiter`s),
the admission of each request as its tenant's work (`InFlight.admit`, in the step that admits it),
the memory promised to admitted loads on their way to the card (`Reservations`), what is known to be
on the card (`Residency`), what the engines said of their own queues (`EngineReads`), the latest
card reading, and the releases under way or next in line. The rest of the proxy sends it events (a
request arrives, its answer ends, a job ends, a load answered, a release or card read reports back,
the watchdog's engine reads) and asks it through narrow methods, each caller through its port: the
request side through `Door` (door.py), the watchdog through `Reports` (reports.py); what it does to
the world is `HandoffEffects` (effects.py). No other module keeps any of its state.

A pass (`_pass`) reads memory only and awaits nothing. Effects run as tasks that report back, the
way llama-swap's scheduler starts a swap and hears `OnSwapDone`: a card read posts the reading
(`_read_card`), a release runs `HandoffEffects.carry_out` and its end admits the waiters that joined
it (`_release_done`). Releases run one at a time, whoever asked (the queue's own plans, the
watchdog, the admin API): the next waits in line as state, not on a lock (`release_line.py`). The
waiting requests are `Ticket`s in a `WaitList` (`waitlist.py`: which are planned, which wait for whom,
which ran out of time). Meanwhile work that
needs no release (a model already on the card, a load that fits) is admitted in the same pass.

The plan runs again as soon as something that could change it happens (`kick()`: a request or a
job ended, a reservation settled, a release ended, a waiter left). While anyone waits the card is
also read again every `REPLAN_S`: memory that comes back outside the proxy (a process exiting, an
admitted load reaching the card, an engine's own unload) sends no event. Every effect goes through
`HandoffEffects`, so unit tests drive the scheduler with a recording fake and an injected clock,
without sockets; tests/unit/test_scheduler_model.py drives it at random against a model of the box.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from proxy.config.schema import Tenant
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.busy import CONFIRM_SLACK_BYTES, StatesOnDemand, at_once_room, busy_states
from proxy.handoff.decisions import (
    HandoffKind,
    Rejected,
)
from proxy.handoff.effects import HandoffEffects as HandoffEffects
from proxy.handoff.evidence import EngineReads
from proxy.handoff.hold import SwapHold, swap_hold
from proxy.handoff.inflight import InFlight, TenantTraffic, Token
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.peaks import Peaks
from proxy.handoff.per_card import plan_on_devices, schedule_on_devices
from proxy.handoff.plan import Plan, TenantState, unplanned_plan
from proxy.handoff.policy import (
    RESIDENT,
    Releasing,
    RoomyPlans,
    Verdict,
    Waiter,
    may_overtake,
    promised_by_tenant,
    resident_fit,
)
from proxy.handoff.release_line import ReleaseLine
from proxy.handoff.reservations import Reservations
from proxy.handoff.residency import Residency, slot
from proxy.handoff.tickets import Admitted as Admitted
from proxy.handoff.tickets import Handoff as Handoff
from proxy.handoff.tickets import Ticket, Underway, wait_entry
from proxy.handoff.unloads import Unloads
from proxy.handoff.waitlist import WaitList, note_end, note_resolved, note_wait
from proxy.tasks import sleep_or_wake

log = logging.getLogger("hyperswap.handoff")

REPLAN_S = 1.0  # the card is read again this often while anyone waits: memory freed outside the proxy sends no event


class Scheduler:
    """The one owner of admission state (see the module's docstring)."""

    def __init__(self, effects: HandoffEffects, traffic: InFlight, *, fresh_s: float = 2.5,
                 runs_at_once: Callable[[str], int | None] = lambda tenant: None) -> None:
        self.effects = effects
        self.runs_at_once = runs_at_once  # tenant -> how many requests its engine runs at once (None: no bound)
        self.traffic = traffic  # admitted work: only `_admit` moves a request into it
        self.reservations = Reservations()
        # confirmed again every watchdog tick; a load unconfirmed for two ticks is planned for again
        self.residency = Residency(effects.clock, fresh_s=fresh_s)
        self.engine_reads = EngineReads()
        self.peaks = Peaks()  # what each load was seen to take while its work ran
        self._roomy = RoomyPlans()  # at-once admissions' plans on the latest reading
        self._busy_keys: dict[str, set[str]] = {}  # tenant -> the loads admitted to it since it was last idle
        self._leaving = Unloads()  # unloads the card does not show done yet
        self.card: AttributedSnapshot | None = None  # the latest card reading, whoever read it
        self._ids = itertools.count(1)
        self._tickets = WaitList()  # the requests waiting for memory
        # one release at a time, whoever asked (`release_line.py`)
        self._underway = ReleaseLine(lambda order, fresh: self.effects.carry_out(order, fresh), self._release_done)
        self._settle_on_idle: dict[str, list[Handoff]] = {}  # tenant -> promises kept until it has no work
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._card_wanted = True  # something changed since the card was last read: read it before the next pass
        self._read_failed: Exception | None = None  # a card read that raised, for the driver to pass on
        traffic.on_change.append(self._traffic_changed)

    # -- events from the rest of the proxy -------------------------------------------------------
    def kick(self) -> None:
        """Something that can change a plan happened: read the card and run a pass now."""
        self._card_wanted = True
        if self._tickets:
            self._wake.set()

    def _traffic_changed(self, tenant: str, traffic: TenantTraffic) -> None:
        if traffic.busy:
            return
        self._busy_keys.pop(tenant, None)
        for handoff in self._settle_on_idle.pop(tenant, []):
            self.settle(handoff)
        self.kick()  # a blocker may have gone idle: whoever waits for it is planned again now

    def observe_card(self, snap: AttributedSnapshot, read_at: float | None = None) -> None:
        """A card reading, from whoever read it (a pass, a release's confirmation, the watchdog, the
        API): the latest is what the next pass plans with. It shows what happened before it was taken
        (`taken_at`; 0: a reading that says not when, a test's card) or before its read began
        (`read_at`, where the reader knows: the scheduler's own reads), whichever is later."""
        self.card = snap
        read_at = max(snap.snapshot.taken_at, read_at or 0.0)
        if read_at > 0:
            self.reservations.confirmed(read_at)  # promises that ended before this read are on the card it shows
        self._unload_seen(snap, read_at)
        if not snap.estimated:
            for tenant, keys in self._busy_keys.items():
                if len(keys) == 1 and self.traffic.busy(tenant):  # all its work is of one load: its peak so far
                    self.peaks.seen(next(iter(keys)), snap.held_by(tenant))
        for t in self.effects.registry:
            if snap.held_by(t.name) <= t.idle_vram_bytes + CONFIRM_SLACK_BYTES:
                self.residency.forget(t.name)  # nothing of it is on the card any more

    def loaded(self, tenant: str, key: str) -> None:
        """The engine answered an admitted request for this load: it is on the card now."""
        self.residency.loaded(tenant, key)

    def unloaded(self, tenant: str, key: str | None = None) -> None:
        """This load (every load of the tenant, when None) may have left the card: an unload passed,
        an OOM, a release began."""
        self.residency.forget(tenant, key)

    def observe_loads(self, tenant: str, loads: Mapping[str, float]) -> None:
        """The engine's own list of what it holds (load key -> its own unload deadline), read by the
        watchdog: it replaces what the proxy believed of that tenant."""
        self.residency.observe(tenant, loads)

    def queue_read(self, tenant: str, started_at: float, job_ids: tuple[str, ...] | None) -> None:
        """What the engine's own queue said was running (None: it did not answer), read by the watchdog."""
        self.engine_reads.queue_read(tenant, started_at, job_ids)

    def on_cpu(self, tenant: str, cpu: bool) -> None:
        """What the engine said of its device, asked by the watchdog."""
        self.engine_reads.on_cpu(tenant, cpu)

    def settle(self, handoff: Handoff | None) -> None:
        """The admitted request reached the engine (or gave up): its promise ends. Idempotent, and
        only ever the handoff's own, so it never ends another request's promise."""
        if handoff is not None and handoff.reservation is not None:
            self.reservations.release(handoff.reservation, self.effects.clock.now())
            handoff.reservation = None
            self.kick()

    def settle_when_idle(self, handoff: Handoff | None) -> None:
        """For a job that outlives its HTTP answer (a ComfyUI prompt loads after `POST /prompt`
        returns): the promise lasts until its tenant has no work any more (an event, not a task)."""
        if handoff is None or handoff.reservation is None:
            return
        tenant = handoff.plan.requester
        if self.traffic.busy(tenant):
            self._settle_on_idle.setdefault(tenant, []).append(handoff)
        else:
            self.settle(handoff)

    # -- reading the state (narrow, read-only) ------------------------------------------------------
    @property
    def releasing(self) -> tuple[Releasing, ...]:
        """The releases under way or in line, whoever started them."""
        return self._underway.states

    @property
    def cpu_tenants(self) -> frozenset[str]:
        return frozenset(self.engine_reads.cpu)

    def states(self, snap: AttributedSnapshot, now: float | None = None) -> dict[str, TenantState]:
        """Every tenant's busy state on `snap` at `now` (default: the clock's), by the pure rule in
        proxy/handoff/busy.py: admitted work and the engines' reads, never a request that waits (it
        writes nothing)."""
        reads = self.engine_reads
        return busy_states(self.effects.registry, self.traffic.snapshot(), reads.queues, self.traffic.finished,
                           snap.held_by, self.effects.clock.now() if now is None else now,
                           observable=lambda name: not snap.estimated and name not in reads.cpu,
                           unreachable_since=reads.unreachable_since,
                           job_lost_after_s=self.effects.registry.config.proxy.job_lost_after_s)

    def swap_hold(self) -> SwapHold:
        """proxy.swap_hold_s with the tenants it applies to now (`hold.SwapHold`): those whose admitted
        work is open (active now) or ran or ended within proxy.swap_hold_recent_s."""
        registry = self.effects.registry
        return swap_hold(registry.config.proxy, registry, self.traffic.snapshot(), self.effects.clock.now())

    def promised(self, snap: AttributedSnapshot) -> dict[str, tuple[str, int]]:
        """Load key -> (tenant, bytes) admitted loads will still take from free memory."""
        return self.reservations.promised(snap)

    def loading(self, key: str) -> bool:
        """An admitted load under this key has not finished reaching the card."""
        return self.reservations.loading(key)

    def standing(self) -> Mapping[str, str]:
        """Load key -> tenant of every promise not ended yet (an admitted load still on its way)."""
        return self.reservations.tenants()

    def resident(self, tenant: str, key: str) -> bool:
        """This load is on the card already, or on its way there (admitted, not arrived yet)."""
        return self.residency.holds(tenant, key) or self.reservations.loading(key, tenant)

    def loads_of(self, tenant: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(on the card, on their way to it): the tenant's load keys, for a cluster's picker (/metrics).
        A load that arrived is only on the card, even while its reservation still stands."""
        resident = tuple(sorted(self.residency.keys(tenant)))
        loading = tuple(sorted(k for k, t in self.reservations.tenants().items() if t == tenant and k not in resident))
        return resident, loading

    # -- the request side ------------------------------------------------------------------------
    def admit_at_once(self, tenant: Tenant, key: str, need_bytes: int, work: Token | None = None) -> Admitted | None:
        """The scheduler's first step for a request, taken without reading the card again: a load that
        is on the card already (or on its way there) runs now, ahead of requests that wait to swap its
        tenant away, within the fairness bound (`policy.may_overtake`), if the latest reading has
        room for its peak (`need_bytes`: what is not on the card plus its working memory, planned
        like any other request's with every promise counted): a render on a resident checkpoint
        still samples. Its growth is reserved until its work ends. None: it goes through `request`
        (its tenant is being swapped away, a waiter may not be overtaken any more, its engine runs as
        many as it can at once while someone waits for it, a waiter not planned yet may be one that
        waits for it, or the latest reading has no room for it)."""
        snap = self.card
        if snap is None or tenant.name in self._leaving or not self.resident(tenant.name, key):
            return None
        need_bytes = self.peak_need(key, need_bytes)
        if self._underway.promised_away(tenant.name):
            return None  # its memory is promised to another load: the release must not be undone
        blocking = self._tickets.waiting_for(tenant.name)
        if blocking is None:
            return None  # a waiter the scheduler has not seen yet: let the next pass order both
        settings = self.effects.registry.config.proxy
        now = self.effects.clock.now()
        if blocking and self.at_once_room().get(tenant.name, 1) <= 0:
            return None  # the engine would only queue it: the proxy's queue orders it instead (fairness)
        if not all(may_overtake(self._waiter(t), now, settings.starvation_after_s, settings.overtake_limit)
                   for t in blocking):
            return None
        plan = self._roomy_plan(snap, tenant.name, key, need_bytes)
        if plan is None:
            return None  # no room for its peak on the latest reading: planned on a fresh one
        for t in blocking:
            t.overtaken += 1
        w = Waiter(next(self._ids), tenant.name, key, need_bytes, tenant.priority, now, resident=True)
        if work is not None:
            self._admit(work, key)
        return Admitted("run", self._resident_handoff(w, plan, snap), RESIDENT)

    def _roomy_plan(self, snap: AttributedSnapshot, tenant: str, key: str, need_bytes: int) -> Plan | None:
        """The resident plan of a load's peak on `snap` with every promise counted, when it has room
        with no release (else None): the same reading and promises give the same plan (`RoomyPlans`)."""
        promised = promised_by_tenant(self._claims(snap), key)
        memo = (tenant, need_bytes, tuple(sorted(promised.items())))
        if (known := self._roomy.find(snap, self.effects.registry, memo)) is not None:
            return known
        states = StatesOnDemand(partial(self.states, snap, self.effects.clock.now()))  # read only when short
        plan = plan_on_devices(snap, self.effects.registry, states, tenant, need_bytes, promised=promised)
        if not plan.feasible or plan.releases:
            return None
        roomy = resident_fit(plan)
        self._roomy.keep(snap, self.effects.registry, memo, roomy)
        return roomy

    def peak_need(self, key: str, estimate: int) -> int:
        """What a request for this load is planned on: its estimate, or the most the load was seen to
        take while it ran, whichever is larger (`Peaks`)."""
        return max(estimate, self.peaks.of(key) or 0)

    def at_once_room(self) -> dict[str, int]:
        """Tenant -> how many more requests its engine runs at once (`runs_at_once`) beyond the work
        admitted to it now; tenants with no such bound are absent. While another tenant's request
        waits for a tenant, it is given no more than this, so the proxy's queue, not the engine's,
        orders the rest (priority, the fairness bounds)."""
        return at_once_room(self.effects.registry, self.traffic.snapshot(), self.runs_at_once)

    def _resident_handoff(self, w: Waiter, plan: Plan, snap: AttributedSnapshot | None) -> Handoff:
        """A resident admission. What its peak adds to what its tenant holds is reserved until its work
        ends (a render on a resident checkpoint samples; a concurrent plan must not hand that memory
        out). A load still on its way is joined: its reservation lasts until this request is done too,
        or the first request's leaving would give back memory the load still takes (the randomized
        model test found that)."""
        handoff = Handoff(plan, [], None, snap)
        if self.reservations.loading(w.key, w.tenant) or plan.need_bytes > plan.held_by_requester:
            self.reserve(w.key, handoff)
        return handoff

    def _claims(self, snap: AttributedSnapshot) -> dict[str, tuple[str, int]]:
        """Load key -> (tenant, bytes) admitted loads and releases under way still count on."""
        return self._underway.claims(self.promised(snap))

    async def request(self, tenant: Tenant, key: str, need_bytes: int, trigger: str, kind: HandoffKind = "plan",
                      model: str | None = None, work: Token | None = None) -> Admitted:
        """Wait for this load's turn. `work`: the request's traffic token, admitted (counted as the
        tenant's work) in the same step that admits the request, never while it waits. A client that
        leaves (its task cancelled) leaves the queue and gives back anything it was promised
        meanwhile; a release started for it runs to its end."""
        clock = self.effects.clock
        need_bytes = self.peak_need(key, need_bytes)
        w = Waiter(next(self._ids), tenant.name, key, need_bytes, tenant.priority, clock.now())
        ticket = Ticket(w, trigger, kind, asyncio.get_running_loop().create_future(), clock.wall(), model=model,
                         work=work)
        self._tickets[w.id] = ticket
        self._card_wanted = True  # planned on a reading taken after it arrived, never on an older one
        self._start_driver()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if self._tickets.pop(w.id, None) is not None:
                note_end(self.effects.decisions, ticket, "client left while waiting", self.effects.clock.now())
                self.kick()
            if ticket.future.done() and not ticket.future.cancelled():
                self.settle(ticket.future.result().handoff)
            raise

    def waiting(self) -> list[dict[str, Any]]:
        """Each waiting request, for people: tenant, since when, waiting for whom and why."""
        now = self.effects.clock.now()
        return sorted((wait_entry(t, now) for t in self._tickets.values()), key=lambda d: d["id"])

    def wait_of(self, work: Token) -> dict[str, Any] | None:
        """The `waiting()` entry of the request whose traffic token is `work`, plus `planned`: True
        once its plan says it waits (for busy tenants, behind a waiter) or joined a release, so
        waiting can succeed (a 507 resolves it at once, never as a wait). None: it does not wait
        (admitted, refused, or not asked yet). The GPU gate reads it to tell a streamed request
        why it waits (proxy/relay/progress.py); nothing else of the ticket leaves the scheduler."""
        ticket = self._tickets.of_work(work)
        if ticket is None:
            return None
        entry = wait_entry(ticket, self.effects.clock.now())
        v = ticket.verdict
        entry["planned"] = ticket.joined is not None or (v is not None and v.action == "wait")
        entry["releasing"] = list(ticket.joined.state.tenants) if ticket.joined is not None else []
        return entry

    # -- the one release path --------------------------------------------------------------------
    def release(self, order: ReleaseOrder, *, key: str | None = None, waiter: int | None = None) -> asyncio.Future[Released]:
        """Start a release (or line it up behind the one under way) and return at once. Its tenants
        count as being released until it ends (their new work waits, no other plan takes their
        memory); when it ends the waiters that joined it are admitted and the queue is woken. Callers
        other than the scheduler itself (the watchdog, the admin API) may await the future, shielded
        (a caller that goes away must not cut a release half way): a pass never awaits it."""
        return self._underway.start(order, key, waiter).done

    def _release_done(self, underway: Underway, task: asyncio.Task[Released]) -> None:
        """OnSwapDone: the release ended (or failed); admit whoever joined it, start the next one in
        line, plan the rest again."""
        joined = self._tickets.joined_to(underway)
        if task.cancelled():
            for ticket in joined:
                self._tickets.pop(ticket.waiter.id, None)
                ticket.future.cancel()
            underway.done.cancel()
        elif (exc := task.exception()) is not None:
            self._release_failed(underway, joined, exc)
        else:
            released = task.result()
            self._release_ended(underway, joined, released)
            if not underway.done.done():
                underway.done.set_result(released)
        self._underway.finished(underway)
        self.kick()
        if self._tickets:
            self._start_driver()

    def _release_failed(self, underway: Underway, joined: list[Ticket], exc: BaseException) -> None:
        log.error("release of %s failed", ", ".join(underway.state.tenants), exc_info=exc)
        for ticket in joined:
            self._tickets.pop(ticket.waiter.id, None)
            if not ticket.future.done():
                ticket.future.set_exception(exc)
        if not underway.done.done():
            underway.done.set_exception(exc)
            underway.done.exception()  # a caller that did not await it must not leave it unretrieved

    def _release_ended(self, underway: Underway, joined: list[Ticket], released: Released) -> None:
        """Admit the waiters that joined the release, unless a tenant it counted on had work again
        (then they are planned again)."""
        if any(r.busy for r in released.results):
            for ticket in joined:
                ticket.joined = None
            return
        plan = underway.order.plan
        for ticket in joined:
            handoff = Handoff(plan or _no_plan(ticket.waiter), released.results, released.decision,
                              underway.order.snapshot)
            self.reserve(ticket.waiter.key, handoff)
            reason = ticket.verdict.reason if ticket.verdict else (plan.explanation if plan else "released")
            self._resolve(ticket, Admitted("run", handoff, reason))

    # -- the driver ------------------------------------------------------------------------------
    def _start_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive(), name="hyperswap:scheduler")
        self._wake.set()

    async def aclose(self) -> None:
        for ticket in list(self._tickets.values()):
            if not ticket.future.done():
                ticket.future.cancel()
        self._tickets.clear()
        tasks: list[asyncio.Task[Any]] = list(self._underway.cancel())
        for task in (self._driver, self._reading):
            if task is not None:
                tasks.append(task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _waiter(self, ticket: Ticket) -> Waiter:
        """The ticket as the pure scheduler sees it now: whether its load is resident (an OOM retry
        never is: what is on the card was not enough) and how often it was overtaken so far."""
        w = ticket.waiter
        resident = ticket.kind != "oom_retry" and self.resident(w.tenant, w.key)
        waits_for = ticket.verdict.waiting_for if ticket.verdict is not None and ticket.verdict.action == "wait" else ()
        return replace(w, resident=resident, overtaken=ticket.overtaken, waits_for=waits_for)

    def _read_card(self) -> None:
        """Start a card read as a task that posts the reading and wakes the driver (one at a time)."""
        if self._reading is not None and not self._reading.done():
            return
        self._card_wanted = False
        started = self.effects.clock.now()

        async def read() -> None:
            try:
                self.observe_card(await self.effects.read_card(), read_at=started)
            except Exception as exc:  # the reader falls back to the engines' reports; this is a bug: tell the waiters
                self._read_failed = exc
            finally:
                self._wake.set()

        self._reading = asyncio.create_task(read(), name="hyperswap:card-read")

    async def _drive(self) -> None:
        """Only ever waits for an event (the wake) or the next deadline; each pass is `_pass`."""
        try:
            while self._tickets:
                self._wake.clear()
                self._expire()
                if not self._tickets.planned():
                    if not self._tickets:
                        break
                    await self._wake.wait()  # only waiters of releases under way: they report back
                    continue
                if self._read_failed is not None:
                    failed, self._read_failed = self._read_failed, None
                    raise failed  # every planned waiter gets it (below), as a pass that cannot read cannot plan
                if self._card_wanted or self.card is None:
                    self._read_card()
                    await self._wake.wait()  # the reading posts itself, or another event comes first
                    continue
                if self._reading is not None and not self._reading.done():
                    await self._wake.wait()
                    continue
                if self._pass(self.card):
                    continue
                await sleep_or_wake(self.effects.clock, self.next_pause(), self._wake)
                self._card_wanted = True  # the replan timer: memory may have come back unannounced
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a waiter hanging on a broken pass
            log.exception("scheduler pass failed")
            for ticket in self._tickets.planned():
                self._tickets.pop(ticket.waiter.id, None)
                if not ticket.future.done():
                    ticket.future.set_exception(exc)

    def _pass(self, snap: AttributedSnapshot) -> bool:
        """One pass on the latest card: who runs, waits or is refused, carried out at once, awaiting
        nothing. True when anyone left the queue (the next pass sees a new state)."""
        pending = self._tickets.planned()
        if not pending:
            return False
        if not snap.snapshot.device.size_known:
            self._forward_unplanned(snap, pending)
            return True
        states = self.states(snap)
        held_back = [t for t in pending if t.waiter.tenant in self._leaving]
        for t in held_back:  # its tenant's unload is not on the card yet: what it holds is on its way out
            w = t.waiter
            plan = plan_on_devices(snap, self.effects.registry, states, w.tenant, w.need_bytes)
            t.verdict = Verdict(w, "wait", plan, f"queued until the unload of {w.tenant} shows on the card")
            self._note_wait(t, t.verdict)
        pending = [t for t in pending if t not in held_back]
        if not pending:
            return False
        settings = self.effects.registry.config.proxy
        verdicts = schedule_on_devices(snap, self.effects.registry, states, [self._waiter(t) for t in pending],
                                       self._claims(snap), self.effects.clock.now(), settings.starvation_after_s,
                                       self.releasing, settings.overtake_limit, self.swap_hold(), self.at_once_room())
        return self._apply(verdicts, snap)

    def _expire(self) -> None:
        """Past `proxy.queue_timeout_s`: 503. A waiter whose release is under way is not cut off:
        the release has a timeout of its own, and its memory is coming."""
        for ticket in self._tickets.overdue(self.effects.clock.now(), self.effects.registry.config.proxy.queue_timeout_s):
            plan = ticket.verdict.plan if ticket.verdict else None
            why = ticket.verdict.reason if ticket.verdict else "no plan could be made"
            self._resolve(ticket, Admitted("timeout", Handoff(plan or _no_plan(ticket.waiter), [], None), why))

    def next_pause(self) -> float:
        """Seconds until the driver's next pass is due at the latest (a queue timeout, a waiter aging
        past the fairness bound, a held swap's end, or `REPLAN_S`), from the clock's now."""
        settings = self.effects.registry.config.proxy
        return self._tickets.next_pause(self.effects.clock.now(), settings.queue_timeout_s,
                                        settings.starvation_after_s, REPLAN_S)

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
                decision = self.effects.decisions.emit(Rejected(tenant=v.waiter.tenant, trigger=ticket.trigger, plan=v.plan,
                                                           status=507, reason=v.reason))
                self._resolve(ticket, Admitted("refuse", Handoff(v.plan, [], decision, snap), v.reason))
                progressed = True
            elif v.action == "wait":
                self._note_wait(ticket, v)
            elif v.plan.releases:
                self._join_or_start(ticket, v, snap)
            elif v.reason == RESIDENT:  # on the card already, or joins the reservation of the load on its way
                self._resolve(ticket, Admitted("run", self._resident_handoff(v.waiter, v.plan, snap), v.reason))
                progressed = True
            else:
                handoff = Handoff(v.plan, [], None, snap)
                self.reserve(v.waiter.key, handoff)
                self._resolve(ticket, Admitted("run", handoff, v.reason))
                progressed = True
        return progressed

    def _join_or_start(self, ticket: Ticket, v: Verdict, snap: AttributedSnapshot) -> None:
        """A load that runs once its releases are done: join the release under way for the same load,
        or start one (the pure scheduler lets at most one start while none is under way)."""
        underway = self._underway.for_load(v.waiter.key)
        if underway is None:
            if ticket.model:  # the disk read overlaps the release instead of following it
                self.effects.prepare_load(v.waiter.tenant, ticket.model)
            order = ReleaseOrder(v.waiter.tenant, v.plan.releases, ticket.trigger, ticket.kind, v.plan, snap)
            underway = self._underway.start(order, v.waiter.key, v.waiter.id)
        ticket.joined = underway

    def _forward_unplanned(self, snap: AttributedSnapshot, pending: list[Ticket]) -> None:
        """Nothing to plan with (reader broken, no engine reports the card): forward, never block."""
        for ticket in pending:
            plan = unplanned_plan(ticket.waiter.tenant, ticket.waiter.need_bytes)  # what GET /api/plan says too
            self._resolve(ticket, Admitted("run", Handoff(plan, [], None, snap), plan.explanation))

    # -- bookkeeping -----------------------------------------------------------------------------
    def _resolve(self, ticket: Ticket, admitted: Admitted) -> None:
        self._tickets.pop(ticket.waiter.id, None)
        admitted.handoff.waited_s = self.effects.clock.now() - ticket.waiter.arrived_at
        note_resolved(self.effects.decisions, ticket, admitted)
        if not ticket.future.done():
            if admitted.outcome == "run" and ticket.work is not None:
                self._admit(ticket.work, ticket.waiter.key)  # work from this step on: no pass sees it idle in between
            ticket.future.set_result(admitted)
        elif admitted.outcome == "run":
            self.settle(admitted.handoff)  # its client left at this very moment

    def admit_unplanned(self, work: Token, tenant: str, key: str) -> None:
        """A request that loads nothing (an unload): its tenant's work at once, and the load leaves the
        card. Nothing but the scheduler makes a request work (one owner). The engine answers before
        the memory is back (engine-wire-facts: both free asynchronously), so until a reading shows it
        gone the tenant's next requests wait: planned on a reading that still shows the model, a chat
        counted that memory as its own, the memory went to a render, and the reload ran out of it."""
        if self.card is not None and any(slot(k) == slot(key) for k in self.residency.keys(tenant)):
            self._leaving.begun(tenant, self.effects.clock.now(), self.card.held_by(tenant))
        self.residency.forget(tenant, key)
        self.traffic.admit(work)

    def _unload_seen(self, snap: AttributedSnapshot, read_at: float) -> None:
        registry = self.effects.registry

        def timeout_of(tenant: str) -> float:
            return registry.get(tenant).release_timeout_s if tenant in registry else 0.0

        def floor_of(tenant: str) -> int:
            return registry.get(tenant).idle_vram_bytes if tenant in registry else 0
        if self._leaving.seen(snap, read_at, self.effects.clock.now(), timeout_of, floor_of):
            self.kick()

    def _admit(self, work: Token, key: str) -> None:
        """The request becomes its tenant's work now, for this load (its peak is learned while it runs)."""
        self.traffic.admit(work)
        self._busy_keys.setdefault(work.tenant, set()).add(key)

    def reserve(self, key: str, handoff: Handoff) -> None:
        """Promise the admitted load its memory until it reaches the card (`settle` ends it)."""
        self.reservations.reserve(key, handoff.plan)
        handoff.reservation = key

    def _note_wait(self, ticket: Ticket, v: Verdict) -> None:
        if ticket.queued is None and ticket.model:  # waiting for a busy tenant is time the disk can use
            self.effects.prepare_load(v.waiter.tenant, ticket.model)
        note_wait(self.effects.decisions, ticket, v)


def _no_plan(w: Waiter) -> Plan:
    return Plan(w.tenant, w.need_bytes, 0, 0, False, True, (), (), "no plan was made before the queue timeout", True)
