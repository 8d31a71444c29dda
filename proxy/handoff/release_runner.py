"""Carrying out a release: the effect behind `Scheduler.release`, the one release path (the
scheduler runs one at a time, as a task). Each tenant that is still idle is asked to give its
memory back (its engine's release, a stop of its app, a suspend of its processes: its `release`
steps in order), and the release is done when the card shows the memory back, never on the
engine's 200 (invariant 6); a busy tenant is never released (invariant 5).

    runner = ReleaseRunner(registry, clock, decisions, inflight, scheduler, lifecycles, control,
                           adapters, card_reader)
    released = await runner.carry_out(order, fresh=False)   # run by the scheduler as a task
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import httpx

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import ReleaseSpec, Tenant
from proxy.engines import ReleaseFailed
from proxy.engines.ports import Releaser
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.busy import CONFIRM_SLACK_BYTES
from proxy.handoff.card_reader import CardReader
from proxy.handoff.decisions import DecisionLog, HandoffFinished, HandoffStarted, ReleaseResult
from proxy.handoff.inflight import InFlight
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.release_result import StepResult
from proxy.handoff.reports import Reports
from proxy.handoff.sleepers import Lifecycles
from proxy.lifecycle import report_json


class ReleaseRunner:
    def __init__(self, registry: Registry, clock: Clock, decisions: DecisionLog, inflight: InFlight,
                 scheduler: Reports, lifecycles: Lifecycles, control: httpx.AsyncClient,
                 adapter: Callable[[Tenant], Releaser], card_reader: CardReader) -> None:
        self.registry = registry
        self.clock = clock
        self.decisions = decisions
        self.inflight = inflight
        self.scheduler = scheduler  # who is busy on a reading; a load that may have left the card
        self.lifecycles = lifecycles  # the apps the proxy stops, suspends and starts
        self.control = control
        self.adapter = adapter
        self.card_reader = card_reader  # a fresh reading, posted to the scheduler

    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        """The effect behind `Scheduler.release`, the one release path (the scheduler runs one at a
        time): log the order, release each tenant that is still idle (invariant 5: a busy one is
        never released) and wait for the card to show the memory back. Run as a task, so a release is
        never cut half way by a client leaving and the scheduler never waits for it. `fresh`: the
        order waited behind another release, so the card is read again first."""
        snap = order.snapshot
        if snap is None or fresh:  # the card may have changed while another release ran
            snap = await self.card_reader.read()
        states = self.scheduler.states(snap)  # the rule the plan was made with, so a stale job never loops
        busy = [r for r in order.releases if r.tenant in states and states[r.tenant].busy]
        skipped = [ReleaseResult(r.tenant, r.expected_free_bytes, 0, 0.0, False,
                                 f"{r.tenant} had work again when its release's turn came: not released", busy=True)
                   for r in busy]
        todo = [r for r in order.releases if r not in busy]
        if not todo:
            return Released(order, skipped, None)  # nothing was asked: nothing to record
        started = self.decisions.emit(HandoffStarted(
            kind=order.kind, tenant=order.requester, trigger=order.trigger, plan=order.plan,
            held_bytes=order.held_bytes, held_by_device=order.held_by_device, idle_s=order.idle_s,
            not_released_busy=tuple(r.tenant for r in skipped)))
        results = [await self.execute_release(self.registry.get(r.tenant), r.expected_free_bytes, snap, stop=order.stop)
                   for r in todo]
        self.decisions.emit(HandoffFinished(kind=order.kind, tenant=order.requester, trigger=order.trigger,
                                            refers_to=started.id, releases=tuple(results)))
        return Released(order, [*results, *skipped], started)

    async def execute_release(self, tenant: Tenant, expected: int, before: AttributedSnapshot | None = None,
                              *, stop: bool = False) -> ReleaseResult:
        """Ask, then confirm on the GPU: done when the memory is back, never on the engine's 200 (invariant 6).
        A tenant whose `release` is a list tries each step in order (each within its own timeout) until
        one gives the memory back; a stopping step stops the app, only while it is idle (invariant 7).
        `stop`: only the step that stops the app (the admin's stop), the soft ones before it skipped."""
        self.scheduler.unloaded(tenant.name)  # whatever it held is on its way off the card
        before = before or await self.card_reader.read()
        held_before = before.held_by(tenant.name)
        start = self.clock.now()
        steps = [(i, s) for i, s in enumerate(tenant.release_steps) if s.reclaims and (s.stops or not stop)]
        result = ReleaseResult(tenant.name, expected, 0, 0.0, False, "no release step")
        trail: list[StepResult] = []  # for a release that escalates: what each step freed
        held = held_before
        procs = tuple((p.process.pid, p.process.used_bytes or 0) for p in before.processes_of(tenant.name))
        for i, step in steps:
            result = await self._release_step(tenant, step, expected, held_before, held, procs)
            after = held_before - result.freed_bytes
            trail.append(StepResult(i, step.kind, max(0, held - after), result.duration_s, result.result, result.error))
            held = after
            if result.result in ("confirmed", "estimated"):
                if not step.stops:
                    self.lifecycles.released(tenant, step)
                break
            if result.busy:
                break  # work arrived: no later step may stop it either
        return replace(result, steps=tuple(trail) if len(steps) > 1 else (),
                       freed_bytes=max(0, held_before - held), duration_s=self.clock.now() - start)

    async def _release_step(self, tenant: Tenant, step: ReleaseSpec, expected: int, held_before: int,
                            held_now: int, procs: tuple[tuple[int, int], ...] = ()) -> ReleaseResult:
        """One step: ask (or stop the app, or suspend its processes: `procs`, their pids and bytes),
        then watch the card until the tenant is down to its target."""
        stops = step.stops
        target = 0 if stops else max(held_before - expected, 0)
        began = self.clock.now()
        try:
            if stops:
                report = await self.lifecycles.stop(tenant, lambda: self.stop_blocked(tenant.name))
                asked: dict[str, object] = {"stop": report_json.LifecycleReport.of(report).dump()}
                if not report.ok:
                    return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - began, False,
                                         report.error, asked, busy=report.refused and report.state == "running")
            elif step.suspends:
                asked = await self.lifecycles.suspend(tenant, procs)
            else:
                asked = await self.adapter(tenant).release(self.control, step)
        except ReleaseFailed as exc:
            return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - began, False, str(exc))
        timeout_s = step.timeout_s if step.timeout_s is not None else tenant.release_timeout_s
        deadline = began + timeout_s
        while True:
            snap = await self.card_reader.read()
            held_now = snap.held_by(tenant.name)
            if held_now <= target + CONFIRM_SLACK_BYTES:  # on the engines' reports alone it is an estimate
                return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - began,
                                     not snap.estimated, asked=asked, estimated=snap.estimated)
            if self.clock.now() >= deadline:
                return ReleaseResult(tenant.name, expected, max(0, held_before - held_now), self.clock.now() - began,
                                     False, f"memory not back after {timeout_s:g} s", asked, snap.estimated,
                                     timed_out=True)
            await self.clock.sleep(self.registry.config.proxy.release_poll_s)

    def stop_blocked(self, tenant: str) -> bool:
        """A stop would cut work: a GPU request or job in flight, or any request, stream or websocket open."""
        return self.inflight.busy(tenant) or self.inflight.connections(tenant) > 0
