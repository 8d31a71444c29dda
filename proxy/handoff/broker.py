"""The scheduler's effects and the request side's port to it: the card reader (GPU snapshots one
at a time off the loop, falling back to the engines' own reports), the releaser (a release asked
for and confirmed on the card), and admission (a GPU request, the wake of a tenant that sleeps, the
admin's start) handed to the scheduler.

No admission state lives here: waiters, admitted work, reservations, residency, the engines' reads
and the latest card are the `Scheduler`'s (proxy/handoff/scheduler.py), which runs every read and
release as a task that reports back. Who is busy is the pure rule in `busy.py`; who runs, waits or
is refused is the pure `policy.schedule`. The HTTP side (answers, the OOM retry) is the GPU gate
in proxy/relay/gpu_gate.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import ReleaseSpec, Tenant
from proxy.engines import AdapterCache, EngineAdapter, Need, ReleaseFailed
from proxy.engines.ports import SelfReport
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot, Attributor
from proxy.gpu.devices import DevicePlacer
from proxy.gpu.snapshot import DeviceFigure, DeviceMemory, GpuProcess, GpuReader, GpuReadError, GpuSnapshot
from proxy.handoff import per_card
from proxy.handoff.busy import CONFIRM_SLACK_BYTES
from proxy.handoff.decisions import DecisionLog, HandoffFinished, HandoffStarted, Rejected, ReleaseResult
from proxy.handoff.inflight import InFlight, Token
from proxy.handoff.load_events import LoadEvents
from proxy.handoff.oom_need import OOM_HEADROOM_BYTES, oom_retry_need
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import Plan, PlanMode, gib, unplanned_plan
from proxy.handoff.policy import promised_by_tenant
from proxy.handoff.release_result import StepResult
from proxy.handoff.scheduler import Admitted, Handoff, Scheduler
from proxy.handoff.sleepers import Lifecycles
from proxy.lifecycle import report_json
from proxy.lifecycle.cuda_driver import Checkpointer
from proxy.lifecycle.state import LifecycleReport
from proxy.tls import client_context

log = logging.getLogger("hyperswap.arbitration")

RESTORE_AT_STOP_S = 60.0  # each restore at the proxy's stop (GiB at ~12 GB/s: seconds)

__all__ = ["CONFIRM_SLACK_BYTES", "Admitted", "GpuBroker", "Handoff", "ReleaseResult", "gib"]


class GpuBroker:
    def __init__(self, registry: Registry, reader: GpuReader, inflight: InFlight, clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient | None = None,
                 adapter: Callable[[Tenant], EngineAdapter] | None = None, *,
                 lifecycles: Lifecycles | None = None, state_dir: Path | None = None,
                 checkpointer: Checkpointer | None = None) -> None:
        self.registry = registry
        self.reader = reader
        self.attributor = Attributor(registry)
        self.inflight = inflight
        self.clock = clock
        self.decisions = decisions
        self.control = control or httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False,
                                                    verify=client_context())
        # Each tenant's engine adapter (the forwarder's, when the service passes it): one per tenant,
        # so what an adapter learns (Ollama's model sizes) is learnt once.
        self.adapter: Callable[[Tenant], EngineAdapter] = adapter or AdapterCache()
        self.placer = DevicePlacer(registry, lambda t: self.adapter(t).device_flag)  # which card each tenant uses
        # residency is confirmed again every watchdog tick; a load unconfirmed for two ticks is planned for again
        self.scheduler = Scheduler(self, inflight, fresh_s=2 * registry.config.proxy.watchdog_interval_s + 0.5,
                                   runs_at_once=lambda name: self.adapter(registry.get(name)).runs_at_once)
        # tenants the proxy stops and starts, or that owe a resume: started before their next request
        self.lifecycles = lifecycles or Lifecycles(registry, self.adapter, clock, decisions, self.control,
                                                   state_dir=state_dir, checkpointer=checkpointer)
        self.lifecycles.on_change.append(lambda _tenant: self.scheduler.kick())
        self.started_at = clock.now()  # idle deadlines of tenants never seen active count from here
        self._snapshot_lock = asyncio.Lock()  # the reader's: one GPU read at a time
        self.last_read_error: GpuReadError | None = None  # the reader's own health, for /api/health
        self._measured_device: DeviceMemory | None = None  # the last device figures a reader measured
        # loads as events (ahead, begun, on the card, ended): warming and load timing subscribe to them
        self.loads = LoadEvents(clock)

    @property
    def last_snapshot(self) -> AttributedSnapshot | None:
        """The latest card reading (the scheduler's), for views; None before the first read."""
        return self.scheduler.card

    @property
    def cpu_tenants(self) -> frozenset[str]:
        return self.scheduler.cpu_tenants

    # -- reading the card ---------------------------------------------------------------------
    async def snapshot(self) -> AttributedSnapshot:
        """One GPU read at a time, off the loop, posted to the scheduler. A broken reader falls back
        to the engines' own reports."""
        async with self._snapshot_lock:
            try:
                snap = self.placer.place(self.attributor.attribute(await asyncio.to_thread(self.reader.read)))
                self.last_read_error = None
                self._measured_device = snap.snapshot.device
            except Exception as exc:  # a failing reader never stops traffic (invariant 10)
                self.last_read_error = exc if isinstance(exc, GpuReadError) else GpuReadError(
                    "unknown", f"GPU read failed: {exc!r}", "run `hyperswap check`")
                snap = await self._engine_estimate()
            self.scheduler.observe_card(snap)
            return snap

    async def read_card(self) -> AttributedSnapshot:
        return await self.snapshot()

    async def _engine_estimate(self) -> AttributedSnapshot:
        """What the engines say about themselves, marked as an estimate (invariant 10).

        ComfyUI's /system_stats carries device-wide total and free (cudaMemGetInfo); without it
        the last good reading's total is used, and with neither the total is unknown (0, marked
        unknown). Used and free are then unknown too: self-reports do not see other programs."""
        procs: list[AttributedProcess] = []
        device: DeviceMemory | None = None
        for i, tenant in enumerate(self.registry):
            if not tenant.upstream:
                continue
            adapter: SelfReport = self.adapter(tenant)
            held = await adapter.self_reported_bytes(self.control)
            if held is not None:
                proc = GpuProcess(pid=-(i + 1), name=f"[{tenant.name} self-report]", cmdline="", used_bytes=held)
                procs.append(AttributedProcess(proc, tenant.name))
            if device is None:
                device = await adapter.device_report(self.control)
        if device is None:
            # the card does not shrink when its reader breaks: the last measured total stays true
            prev = self._measured_device
            total = prev.total_bytes if prev else 0
            used = sum(p.process.used_bytes or 0 for p in procs)
            unknown: set[DeviceFigure] = {"used", "free", "reserved"}
            if not total:
                unknown.add("total")
            device = DeviceMemory(0, prev.name if prev else "unknown (GPU reader failed)", total, 0, used,
                                  max(0, total - used), unknown=frozenset(unknown))
        raw = GpuSnapshot(device, tuple(p.process for p in procs), source="engine-estimate", taken_at=self.clock.now(),
                          notes=("GPU reader failed: memory figures are the engines' own estimates",))
        return AttributedSnapshot(raw, tuple(procs))

    def held(self, snap: AttributedSnapshot, tenant: str) -> int:
        return snap.held_by(tenant)

    # -- planning -----------------------------------------------------------------------------
    async def plan(self, requester: str, need_bytes: int, key: str = "",
                   snap: AttributedSnapshot | None = None, *, mode: PlanMode = "request") -> tuple[Plan, AttributedSnapshot]:
        """The plan a request would get now (the dry run of `GET /api/plan`, the watchdog's relief)."""
        self.registry.get(requester)
        snap = snap or await self.snapshot()
        if not snap.snapshot.device.size_known:  # as the handoff queue does: forwarded without a plan
            return unplanned_plan(requester, need_bytes), snap
        plan = per_card.plan_on_devices(snap, self.registry, self.scheduler.states(snap), requester, need_bytes,
                                       promised=promised_by_tenant(self.scheduler.promised(snap), key or requester),
                                       mode=mode)
        return plan, snap

    async def execute_release(self, tenant: Tenant, expected: int, before: AttributedSnapshot | None = None,
                              *, stop: bool = False) -> ReleaseResult:
        """Ask, then confirm on the GPU: done when the memory is back, never on the engine's 200 (invariant 6).
        A tenant whose `release` is a list tries each step in order (each within its own timeout) until
        one gives the memory back; a stopping step stops the app, only while it is idle (invariant 7).
        `stop`: only the step that stops the app (the admin's stop), the soft ones before it skipped."""
        self.scheduler.unloaded(tenant.name)  # whatever it held is on its way off the card
        before = before or await self.snapshot()
        held_before = self.held(before, tenant.name)
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
            snap = await self.snapshot()
            held_now = self.held(snap, tenant.name)
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

    # -- waking a tenant that sleeps ------------------------------------------------------------
    def start_need(self, tenant: Tenant) -> Need:
        """What a start (or resume) of a sleeping tenant is planned with, under one load key shared by
        every request that wakes it and the admin's start. A suspended tenant's restore needs what it
        parked in host RAM."""
        parked = self.lifecycles.suspensions.parked_bytes(tenant.name)
        if parked:
            return Need(parked, f"the restore of {tenant.name}", f"{tenant.name}:wake")
        return Need(self.adapter(tenant).start_need_bytes, f"the start of {tenant.name}", f"{tenant.name}:wake")

    async def wake(self, tenant: Tenant, trigger: str) -> Admitted | None:
        """A request reached a tenant that is stopped (or owes a resume): make room for it like for a
        load (idle tenants released, busy ones waited for, 507 only when impossible), then start it
        (concurrent requests share one start) or resume it. None: it is awake, forward. An Admitted
        that is not "run" is the queue's refusal or timeout. Raises LifecycleError (503) when the
        start fails."""
        if not self.lifecycles.dormant(tenant.name):
            return None
        need = self.start_need(tenant)
        admitted = await self.scheduler.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            await self.lifecycles.wake(tenant)
        finally:
            self.scheduler.settle(admitted.handoff)  # it is up: what it loaded is on the card, measured from now
        return admitted

    async def start(self, tenant: Tenant, trigger: str) -> Admitted | LifecycleReport:
        """The admin's start of a tenant the proxy starts: room is made for it exactly as for a request
        that wakes it (`wake`), then it is started, past any backoff after a failed start (an explicit
        ask), sharing a start under way. The queue's refusal or timeout (an Admitted that is not
        "run"), or the start's report (ok, or failed with the reason and the app's last lines)."""
        need = self.start_need(tenant)
        admitted = await self.scheduler.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            return await self.lifecycles.start(tenant, force=True)
        finally:
            self.scheduler.settle(admitted.handoff)  # it is up (or failed): what it holds is measured from now

    async def preload(self, tenant: Tenant) -> LifecycleReport | None:
        """Start a tenant marked `preload` once the proxy is up, its memory planned like any start
        (`start`). Never raises: how it went is kept on its state machine (`preloaded`), where health
        shows a failure until the app runs; a start that failed is a decision too. None: not started
        (it runs already, or the queue refused or timed out)."""
        machine = self.lifecycles.machine(tenant.name)
        if machine is None or machine.state == "running":
            return None
        try:
            outcome = await self.start(tenant, "preload")
        except Exception as exc:  # a preload never breaks the proxy's start
            log.exception("%s: preload failed", tenant.name)
            machine.preloaded(f"{type(exc).__name__}: {exc}", "see the proxy's log")
            return None
        if isinstance(outcome, Admitted):
            if outcome.outcome == "timeout":
                timeout_s = self.registry.config.proxy.queue_timeout_s
                self.decisions.emit(Rejected(tenant=tenant.name, trigger="preload", plan=outcome.handoff.plan,
                                             status=503, reason=outcome.reason))
                error = f"it waited {timeout_s:g} s for GPU memory: {outcome.reason}"
            else:
                error = f"not enough GPU memory for its start even once every busy tenant finished: {outcome.reason}"
            machine.preloaded(error, f"start it when the memory is free (POST /api/tenants/{tenant.name}/start), or "
                                     f"lower what it needs (tenants.{tenant.name}.needs_vram_gb)")
            return None
        machine.preloaded(None if outcome.ok else outcome.error, outcome.fix)
        return outcome

    # -- the scheduler's effects (HandoffEffects) ------------------------------------------------
    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        """The effect behind `Scheduler.release`, the one release path (the scheduler runs one at a
        time): log the order, release each tenant that is still idle (invariant 5: a busy one is
        never released) and wait for the card to show the memory back. Run as a task, so a release is
        never cut half way by a client leaving and the scheduler never waits for it. `fresh`: the
        order waited behind another release, so the card is read again first."""
        snap = order.snapshot
        if snap is None or fresh:  # the card may have changed while another release ran
            snap = await self.snapshot()
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

    def prepare_load(self, tenant: str, model: str) -> None:
        self.loads.ahead(tenant, model)

    async def _restore_at_stop(self) -> None:
        """At the proxy's stop, what it suspended is restored where the card has room for it (smallest
        first): left suspended, an app's CUDA calls block for ever with no proxy to restore it. One
        that does not fit is left suspended and named, with the command that restores it (a restore
        without room fails, and the driver does not promise the process survives that)."""
        sus = self.lifecycles.suspensions
        names = sorted((n for n, r in sus.records().items() if r.dormant), key=sus.parked_bytes)
        if not names:
            return
        snap = await self.snapshot()
        for name in names:
            need, free = sus.parked_bytes(name), per_card.free_for(snap, name)
            if need > free:
                pids = " ".join(str(p) for p in sus.record(name).pids)  # type: ignore[union-attr]
                log.warning("%s stays suspended at the proxy's stop: %s GiB to restore, %s GiB free on the card; once there "
                            "is room: cuda-checkpoint --toggle --pid %s", name, gib(need), gib(free), pids)
                continue
            try:
                await asyncio.wait_for(sus.restore(name), RESTORE_AT_STOP_S)
            except (ReleaseFailed, TimeoutError) as exc:
                log.warning("%s: not restored at the proxy's stop: %s", name, exc)
                continue
            snap = await self.snapshot()

    # -- the request path ---------------------------------------------------------------------
    async def admit(self, tenant: Tenant, path: str, body: bytes, trigger: str,
                    *, oom: bool = False, work: Token | None = None, need: Need | None = None) -> tuple[Admitted, Need]:
        """Make room for a GPU request: at once when its load is already on the card (the scheduler's
        own first step, `Scheduler.admit_at_once`), else through the handoff queue (which may
        wait for busy tenants, up to the queue timeout). `work`: the request's traffic token, counted
        as the tenant's work from its admission on; `need`: estimated already. A client that goes
        away while waiting leaves the queue."""
        need = need or await self.adapter(tenant).estimate_need(path, body, self.control)
        need_bytes = need.bytes
        if oom:  # planned on a fresh reading, the raise capped at what the tenant can reach (handoff/oom_need.py)
            self.scheduler.unloaded(tenant.name)
            snap = await self.snapshot()
            held, free = self.held(snap, tenant.name), per_card.free_for(snap, tenant.name)
            reachable = None
            if snap.snapshot.device.size_known:  # a plan short of memory counts every tenant it could reach
                probe, _ = await self.plan(tenant.name, held + free + OOM_HEADROOM_BYTES, need.key, snap)
                reachable = probe.reachable_bytes
            need_bytes = oom_retry_need(need_bytes, held, free, reachable)
        elif (at_once := self.scheduler.admit_at_once(tenant, need.key, need_bytes, work)) is not None:
            return at_once, need
        admitted = await self.scheduler.request(tenant, need.key, need_bytes, trigger, "oom_retry" if oom else "plan",
                                            model=need.model, work=work)
        if admitted.outcome == "run" and self.lifecycles.suspensions.dormant(tenant.name):
            # suspended while it waited (its wake came first): restored before it is forwarded
            await self.lifecycles.wake(tenant)
        return admitted, need

    async def aclose(self) -> None:
        await self.scheduler.aclose()
        await self._restore_at_stop()
        await self.lifecycles.aclose()
        await self.control.aclose()
