"""The timer loop: idle release deadlines, Ollama's CPU spill, stale queue entries.

Every tick records why each tenant was left alone (several reasons can apply, and without them no
one can tell which fired); `GET /api/tenants/{name}` shows them. It holds the scheduler as `Reports`
(`reports.py`): the engines' reads it posts, the releases it asks for, the little it reads back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.engines import ReleaseFailed
from proxy.engines.common import go_time
from proxy.engines.ports import SelfReport, WatchdogPorts
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.broker import CONFIRM_SLACK_BYTES, GpuBroker, gib
from proxy.handoff.decisions import SpillNoPlan, StaleJob
from proxy.handoff.orders import ReleaseOrder, release_whole, stop_whole
from proxy.handoff.plan import TenantState
from proxy.handoff.reports import Reports
from proxy.tasks import cancel_and_wait

log = logging.getLogger("hyperswap.watchdog")


@dataclass(slots=True)
class TickReport:
    at: float
    reasons: dict[str, str] = field(default_factory=dict)  # tenant -> why nothing (or what) happened
    actions: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Placement:
    """How Ollama placed one model, and since when it has held still."""
    size: int
    size_vram: int
    since: float
    reported: bool = False  # an impossible relief is logged once per placement, not every tick


@dataclass(slots=True)
class _Fruitless:
    """Idle releases of one tenant that freed nothing since its traffic last changed."""
    count: int
    activity: float | None  # the tenant's last activity when they were counted
    at: float  # when the last of them ended


MAX_IDLE_BACKOFF = 64  # the wait after fruitless idle releases doubles up to 64 x idle_release_after_s


class Watchdog:
    def __init__(self, broker: GpuBroker, adapter: Callable[[Tenant], WatchdogPorts]) -> None:
        self.broker = broker
        self.adapter = adapter  # each tenant's engine adapter (the proxy's, shared with the broker and the gate)
        self.scheduler: Reports = broker.scheduler  # all it tells the scheduler and asks of it (reports.py)
        self.last: TickReport | None = None
        self._task: asyncio.Task[None] | None = None
        self._placements: dict[tuple[str, str], _Placement] = {}
        self._fruitless: dict[str, _Fruitless] = {}
        self._reloaded: set[tuple[str, str, int]] = set()  # (tenant, model, size) unloaded once to load whole

    def idle_deadline(self, tenant_name: str) -> float | None:
        """Monotonic time at which the tenant is released if it stays idle; None = never.

        An idle release that freed nothing (an engine whose memory a release cannot reach) would
        otherwise repeat every idle period, each time waiting out its release timeout: after n such
        releases in a row the wait is idle_release_after_s x 2^n (at most x 64), counted from the
        last one. Any traffic of the tenant, or a release that frees memory, starts over."""
        tenant = self.broker.registry.get(tenant_name)
        if tenant.idle_release_after_s is None or not tenant.reclaimable or tenant_name in self.broker.cpu_tenants:
            return None  # (an engine on the CPU has nothing on the card to release)
        traffic = self.broker.inflight.snapshot().get(tenant_name)
        activity = traffic.last_activity if traffic else None
        last = activity if activity is not None else self.broker.started_at
        fruitless = self._fruitless.get(tenant_name)
        if fruitless is not None and fruitless.activity == activity:
            return fruitless.at + tenant.idle_release_after_s * min(1 << fruitless.count, MAX_IDLE_BACKOFF)
        return last + tenant.idle_release_after_s

    def _idle_released(self, name: str, freed: int, at: float) -> None:
        traffic = self.broker.inflight.snapshot().get(name)
        activity = traffic.last_activity if traffic else None
        if freed > CONFIRM_SLACK_BYTES:
            self._fruitless.pop(name, None)
            return
        prev = self._fruitless.get(name)
        count = prev.count + 1 if prev is not None and prev.activity == activity else 1
        self._fruitless[name] = _Fruitless(count, activity, at)

    async def tick(self) -> TickReport:
        broker = self.broker
        report = TickReport(at=broker.clock.now())
        if self.scheduler.releasing:
            report.reasons["*"] = "a handoff is in progress"
            self.last = report
            return report
        await self._read_queues(report)
        snap = await broker.snapshot()
        states = self.scheduler.states(snap)
        for tenant in broker.registry:
            name = tenant.name
            state = states[name]
            held = broker.held(snap, name)
            if state.stale_jobs:
                report.actions.append(f"{name}: stale queue entries {list(state.stale_jobs)}")
                self._end_lost_jobs(name, state, report)
            # Starvation first: Ollama spilling layers to the CPU wants memory now.
            adapter: SelfReport = self.adapter(tenant)
            if adapter.placements_path and tenant.upstream:  # the engine says where each model sits
                try:
                    models = await adapter.placements(broker.control)
                except (httpx.HTTPError, ValueError, ReleaseFailed) as exc:
                    models = None
                    report.reasons[name] = f"cannot read {adapter.placements_path}: {exc}"
                if models is not None:
                    self._observe_residency(tenant, models)
                    spilled = self._stable_spills(tenant, models, report)
                    if spilled:
                        await self._relieve_spill(tenant, spilled, held, report, idle=not state.busy)
                        continue
            await self._idle_step(tenant, state, held, snap, report)
        self.last = report
        return report

    async def _idle_step(self, tenant: Tenant, state: TenantState, held: int, snap: AttributedSnapshot,
                         report: TickReport) -> None:
        """The idle release of one tenant on this tick, or the reason there is none (its state, its
        deadline, what it holds)."""
        name = tenant.name
        machine = self.broker.lifecycles.machine(name)
        deadline = self.idle_deadline(name)
        if machine is not None and machine.state != "running":
            report.reasons[name] = f"{machine.state}: the proxy starts it on its next request"
        elif deadline is None:
            report.reasons.setdefault(name, "no idle release (idle_release_after_s is null, not reclaimable, or on the CPU)")
        elif state.busy:
            report.reasons[name] = f"busy: {state.busy_reason}"
        elif held <= tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES and machine is None:
            # a tenant the proxy stops is stopped when idle whatever it holds (llama-swap's ttl)
            report.reasons[name] = (f"holds {gib(held)} GiB, within its idle floor of "
                                    f"{gib(tenant.idle_vram_bytes)} GiB (idle_vram_gb): nothing to release")
        elif report.at < deadline:
            report.reasons[name] = f"idle release in {deadline - report.at:.0f} s"
        else:
            # an app the proxy starts is stopped by its ttl whatever it holds (llama-swap's ttl): its
            # stopping step alone, or a soft step that "frees" what it can would leave it running for ever
            whole = stop_whole if machine is not None else release_whole
            order = whole(snap, tenant, "watchdog idle", kind="idle_release", why="idle timeout",
                          idle_s=tenant.idle_release_after_s)
            (result,) = (await asyncio.shield(self.scheduler.release(order))).results
            if result.busy:  # work arrived before the release's turn came, or a stop would cut it
                report.reasons[name] = f"busy again: idle release skipped ({result.error})"
                return
            self._idle_released(name, result.freed_bytes, self.broker.clock.now())
            report.actions.append(f"{name}: idle release freed {gib(result.freed_bytes)} GiB")
            report.reasons[name] = "released after idle timeout"

    async def _read_queues(self, report: TickReport) -> None:
        """Jobs the engine's own queue says are running (clients that bypass the proxy, or stale rows)."""
        for tenant in self.broker.registry:
            adapter = self.adapter(tenant)
            queue_path = adapter.queue_path()
            if queue_path is None or not tenant.upstream:
                continue
            started = self.broker.clock.now()  # a row is only believed if read after the traffic last changed
            try:
                rows = tuple(await adapter.running_jobs(self.broker.control))
            except (httpx.HTTPError, ValueError, ReleaseFailed) as exc:
                self.scheduler.queue_read(tenant.name, started, None)
                report.reasons[tenant.name] = f"cannot read {queue_path}: {exc}"
            else:
                self.scheduler.queue_read(tenant.name, started, rows)
            try:  # an engine on the CPU holds nothing on the card: its VRAM proves nothing either way
                self.scheduler.on_cpu(tenant.name, await adapter.runs_on_cpu(self.broker.control))
            except (httpx.HTTPError, ValueError, ReleaseFailed):
                pass  # unknown: what it said last stands

    def _end_lost_jobs(self, name: str, state: TenantState, report: TickReport) -> None:
        """Jobs of an engine whose queue has not answered for proxy.job_lost_after_s: ended, each with
        a stale_job decision saying why (a job lost with an engine that never comes back)."""
        if state.stale_why != "unreachable":
            return
        for job_id in state.stale_jobs:
            if self.broker.inflight.finish_job(name, job_id):
                lost_after = self.broker.registry.config.proxy.job_lost_after_s
                self.broker.decisions.emit(StaleJob(
                    tenant=name, trigger="watchdog: engine not answering", job_id=job_id,
                    reason=f"{name}'s queue has not answered for {lost_after:g} s (proxy.job_lost_after_s): "
                           f"{job_id} is no longer counted as running"))
                report.actions.append(f"{name}: {job_id} ended, its engine silent for {lost_after:g} s")

    def _observe_residency(self, tenant: Tenant, models: list[dict[str, Any]]) -> None:
        """Ollama's own list says what is on the card: fully on the GPU and not about to expire
        (its keep-alive deadline, minus two ticks of margin, ends the fast path)."""
        clock = self.broker.clock
        margin = 2 * self.broker.registry.config.proxy.watchdog_interval_s
        adapter = self.adapter(tenant)
        loads: dict[str, float] = {}
        for m in models:
            if int(m.get("size_vram") or 0) < int(m.get("size") or 0):
                continue
            expires = go_time(m.get("expires_at"))
            if expires is None:
                continue
            loads[adapter.placement_key(m)] = clock.now() + (expires - clock.wall()) - margin
        self.scheduler.observe_loads(tenant.name, loads)

    def _stable_spills(self, tenant: Tenant, models: list[dict[str, Any]], report: TickReport) -> list[dict[str, Any]]:
        """Models on the CPU in part whose split has held still for `spill_stable_s` while no load of
        them is under way: a model that is still loading grows into its place and is no spill."""
        now = self.broker.clock.now()
        stable_s = self.broker.registry.config.proxy.spill_stable_s
        seen: set[tuple[str, str]] = set()
        out = []
        for m in models:
            where = (tenant.name, str(m["name"]))
            seen.add(where)
            size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
            p = self._placements.get(where)
            if p is None or (p.size, p.size_vram) != (size, vram):
                p = self._placements[where] = _Placement(size, vram, now)
            if vram >= size:
                continue
            if self.scheduler.loading(self.adapter(tenant).placement_key(m)):
                report.reasons[tenant.name] = f"{where[1]} is loading ({gib(vram)} of {gib(size)} GiB on the GPU so far)"
                p.since = now
            elif now - p.since < stable_s:
                report.reasons[tenant.name] = (f"{where[1]} has {gib(vram)} of {gib(size)} GiB on the GPU: "
                                               f"a spill if it holds still for {stable_s:g} s")
            else:
                out.append(m)
        for where in [w for w in self._placements if w[0] == tenant.name and w not in seen]:
            del self._placements[where]
        return out

    async def _relieve_spill(self, tenant: Tenant, spilled: list[dict[str, Any]], held: int, report: TickReport,
                             *, idle: bool) -> None:
        """Ollama holds a model partly on the CPU: plan for the whole model on the card, counting
        what Ollama already holds once, and take memory only from tenants below it (relief). Ollama
        never moves a loaded model back on its own: once the card has room, the split model is
        unloaded while Ollama is idle, so the next request loads it whole (`_reload_whole`)."""
        name = tenant.name
        on_gpu = sum(int(m.get("size_vram") or 0) for m in spilled)
        need = max(0, held - on_gpu) + sum(int(m.get("size") or 0) for m in spilled) + tenant.context_allowance_bytes
        models = ", ".join(str(m["name"]) for m in spilled)
        placements = [self._placements[(name, str(m["name"]))] for m in spilled]
        plan, snap = await self.broker.plan(name, need, self.adapter(tenant).placement_key(spilled[0]),
                                                 mode="relief")
        if not plan.starved:
            report.reasons[name] = f"{models} on the CPU in part but the card has room: " + (
                await self._reload_whole(tenant, spilled, report) if idle else "reloaded whole once Ollama is idle")
            return
        if not plan.feasible:
            report.reasons[name] = f"starved (CPU spill) and no plan: {plan.explanation}"
            if not all(p.reported for p in placements):
                self.broker.decisions.emit(SpillNoPlan(tenant=name, trigger=f"watchdog: {models} spilling to the CPU",
                                                    plan=plan))
                for p in placements:
                    p.reported = True
            return
        order = ReleaseOrder(name, plan.releases, f"watchdog: {models} spilling to the CPU", "spill", plan, snap)
        released = await asyncio.shield(self.scheduler.release(order))  # never cut half way
        if released.results:
            report.actions.append(f"{name}: spill of {models}: released {[r.tenant for r in released.results]}")
            report.reasons[name] = "starved (CPU spill): memory reclaimed; " + (
                await self._reload_whole(tenant, spilled, report) if idle and not self._busy(name)
                else "the split model is reloaded whole once Ollama is idle")
        else:
            report.reasons[name] = f"starved (CPU spill): {plan.explanation}"

    def _busy(self, name: str) -> bool:
        traffic = self.broker.inflight.snapshot().get(name)
        return traffic is not None and traffic.busy

    async def _reload_whole(self, tenant: Tenant, spilled: list[dict[str, Any]], report: TickReport) -> str:
        """Unload the split models of an idle tenant (its card has room now): its next request loads
        them whole, planned on the size Ollama split them at (the adapter learned it from the spill)."""
        adapter = self.adapter(tenant)
        done: list[str] = []
        for m in spilled:
            once = (tenant.name, str(m["name"]), int(m.get("size") or 0))
            if once in self._reloaded:  # it split again at the same size: another unload would not help
                continue
            self._reloaded.add(once)
            try:
                if await adapter.unload_model(self.broker.control, str(m["name"])):
                    done.append(str(m["name"]))
                    self.scheduler.unloaded(tenant.name, adapter.placement_key(m))
            except httpx.HTTPError as exc:
                log.warning("%s: cannot unload the split %s: %s", tenant.name, m["name"], exc)
        if not done:
            return "the split model stays (the engine did not unload it, or it split again after a reload)"
        report.actions.append(f"{tenant.name}: unloaded {', '.join(done)} (split with the CPU) to load it whole")
        return f"unloaded {', '.join(done)} while idle: the next request loads it whole"

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="hyperswap:watchdog")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        interval = self.broker.registry.config.proxy.watchdog_interval_s
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watchdog tick failed")
            await self.broker.clock.sleep(interval)


__all__ = ["GIB", "TickReport", "Watchdog"]
