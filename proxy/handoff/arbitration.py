"""The effects of a handoff: GPU snapshots one at a time off the loop, reservations for loads that
were admitted but have not reached the card yet, releases confirmed on the card.

Who is busy is the pure rule in `busy.py`; who runs, waits or is refused is the pure
`arbiter.schedule`, driven by the `HandoffQueue`, which owns what is under way and runs every
release through `carry_out` here as a task. A load already on the card skips the queue when no one
waits. The HTTP side (answers, the OOM retry) is the GPU gate in proxy/relay/gpu_gate.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import httpx

from proxy.clock import Clock
from proxy.engines import AdapterCache, EngineAdapter, Need, ReleaseFailed
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot, Attributor
from proxy.gpu.devices import DevicePlacer
from proxy.gpu.snapshot import DeviceFigure, DeviceMemory, GpuProcess, GpuReader, GpuReadError, GpuSnapshot
from proxy.handoff import devices
from proxy.handoff.arbiter import Plan, PlanMode, TenantState, gib, promised_by_tenant, unplanned_plan
from proxy.handoff.busy import CONFIRM_SLACK_BYTES, QueueRead, busy_states
from proxy.handoff.decisions import DecisionLog, HandoffFinished, HandoffStarted
from proxy.handoff.inflight import InFlight, TenantTraffic, Token
from proxy.handoff.lifecycles import Lifecycles
from proxy.handoff.queue import Admitted, Handoff, HandoffQueue, Released, ReleaseOrder, ReleaseResult
from proxy.handoff.residency import Residency
from proxy.lifecycle.state import LifecycleReport
from proxy.tenants import GIB, Registry, ReleaseSpec, Tenant
from proxy.tls import client_context

log = logging.getLogger("hyperswap.arbitration")

OOM_HEADROOM_BYTES = 1 * GIB  # after an OOM the estimate was wrong: ask for this much more than is free

__all__ = ["CONFIRM_SLACK_BYTES", "Admitted", "Arbitration", "Handoff", "PrepareLoad", "ReleaseResult", "gib"]


@dataclass(slots=True)
class _Reservation:
    tenant: str
    need: int  # net: what the load adds to what the tenant held when admitted
    baseline: int  # what the tenant held when admitted; growth above it means the load arrived
    count: int = 1
    device: int | None = None  # the card it was admitted on, on a host with several


class PrepareLoad(Protocol):
    """The model-files extension's part in a handoff (proxy/admin/models_api.py). Never blocks."""

    def prepare_load(self, tenant: str, model: str) -> None:
        """Memory is about to be released (or waited for) for this load: warm its files meanwhile."""


class Arbitration:
    def __init__(self, registry: Registry, reader: GpuReader, inflight: InFlight, clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient | None = None,
                 adapter: Callable[[Tenant], EngineAdapter] | None = None, *,
                 lifecycles: Lifecycles | None = None, state_dir: Path | None = None) -> None:
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
        # confirmed again every watchdog tick; a load unconfirmed for two ticks is planned for again
        self.residency = Residency(clock, fresh_s=2 * registry.config.proxy.watchdog_interval_s + 0.5)
        self.queue = HandoffQueue(self)
        # tenants the proxy stops and starts, or that owe a resume: started before their next request
        self.lifecycles = lifecycles or Lifecycles(registry, self.adapter, clock, decisions, self.control,
                                                   state_dir=state_dir)
        self.lifecycles.on_change.append(lambda _tenant: self.queue.kick())
        self.started_at = clock.now()  # idle deadlines of tenants never seen active count from here
        self.handoff_lock = asyncio.Lock()  # releases, one at a time: the queue, the watchdog, the admin API
        self._snapshot_lock = asyncio.Lock()
        self._reservations: dict[str, _Reservation] = {}
        self._settlers: set[asyncio.Task[None]] = set()
        self.last_snapshot: AttributedSnapshot | None = None
        self.last_read_error: GpuReadError | None = None
        self._measured_device: DeviceMemory | None = None  # the last device figures a reader measured
        self._queue_reads: dict[str, QueueRead] = {}  # tenant -> jobs its own queue said run (watchdog reads it)
        self._unreachable_since: dict[str, float] = {}  # tenant -> since when its queue does not answer
        self.cpu_tenants: set[str] = set()  # engines that said they compute on the CPU (the watchdog asks)
        self.load_hooks: PrepareLoad | None = None  # set by the model-files extension
        inflight.on_change.append(self._traffic_changed)

    def _traffic_changed(self, tenant: str, traffic: TenantTraffic) -> None:
        if not traffic.busy:
            self.queue.kick()  # a blocker may have gone idle: whoever waits for it is planned again now

    # -- reading the card ---------------------------------------------------------------------
    async def snapshot(self) -> AttributedSnapshot:
        """One GPU read at a time, off the loop. A broken reader falls back to the engines' own reports."""
        async with self._snapshot_lock:
            try:
                snap = self.placer.place(self.attributor.attribute(await asyncio.to_thread(self.reader.read)))
                self.last_read_error = None
                self._measured_device = snap.snapshot.device
            except Exception as exc:  # a failing reader never stops traffic (invariant 10)
                self.last_read_error = exc if isinstance(exc, GpuReadError) else GpuReadError(
                    "unknown", f"GPU read failed: {exc!r}", "run `hyperswap check`")
                snap = await self._engine_estimate()
            self.last_snapshot = snap
            for tenant in self.registry:
                if snap.held_by(tenant.name) <= tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES:
                    self.residency.forget(tenant.name)  # nothing of it is on the card any more
            return snap

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
            adapter = self.adapter(tenant)
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

    # -- busy ---------------------------------------------------------------------------------
    def queue_read(self, tenant: str, started_at: float, job_ids: tuple[str, ...] | None) -> None:
        """What the engine's own queue said was running, read from `started_at` (None: it did not
        answer; since when is kept until it answers again)."""
        if job_ids is None:
            self._queue_reads.pop(tenant, None)
            self._unreachable_since.setdefault(tenant, started_at)
        else:
            self._queue_reads[tenant] = QueueRead(started_at, job_ids)
            self._unreachable_since.pop(tenant, None)

    def on_cpu(self, tenant: str, cpu: bool) -> None:
        """What the engine said of its device (the watchdog asks): an engine on the CPU holds nothing on
        the card, so neither its busy state nor a release can be judged by its VRAM."""
        if cpu:
            self.cpu_tenants.add(tenant)
        else:
            self.cpu_tenants.discard(tenant)

    def states(self, snap: AttributedSnapshot) -> dict[str, TenantState]:
        """Every tenant's busy state now, by the pure rule in proxy/handoff/busy.py (writes nothing)."""
        return busy_states(self.registry, self.inflight.snapshot(), self._queue_reads, self.inflight.finished,
                           snap.held_by, self.clock.now(),
                           observable=lambda name: not snap.estimated and name not in self.cpu_tenants,
                           unreachable_since=self._unreachable_since,
                           job_lost_after_s=self.registry.config.proxy.job_lost_after_s)

    # -- planning -----------------------------------------------------------------------------
    def promised(self, snap: AttributedSnapshot) -> dict[str, tuple[str, int]]:
        """Load key -> (tenant, bytes) admitted loads will still take from free memory."""
        out: dict[str, tuple[str, int]] = {}
        for key, r in self._reservations.items():
            grown = max(0, devices.held_on(snap, r.tenant, r.device) - r.baseline)
            if r.need - grown > 0:
                out[key] = (r.tenant, r.need - grown)
        return out

    def loading(self, key: str) -> bool:
        """An admitted load under this key has not finished reaching the card."""
        return key in self._reservations

    async def plan(self, requester: str, need_bytes: int, key: str = "",
                   snap: AttributedSnapshot | None = None, *, mode: PlanMode = "request") -> tuple[Plan, AttributedSnapshot]:
        """The plan a request would get now (the dry run of `GET /api/plan`, the watchdog's relief)."""
        self.registry.get(requester)
        snap = snap or await self.snapshot()
        if not snap.snapshot.device.size_known:  # as the handoff queue does: forwarded without a plan
            return unplanned_plan(requester, need_bytes), snap
        plan = devices.plan_on_devices(snap, self.registry, self.states(snap), requester, need_bytes,
                                       promised=promised_by_tenant(self.promised(snap), key or requester), mode=mode)
        return plan, snap

    async def execute_release(self, tenant: Tenant, expected: int, before: AttributedSnapshot | None = None,
                              *, stop: bool = False) -> ReleaseResult:
        """Ask, then confirm on the GPU: done when the memory is back, never on the engine's 200 (invariant 6).
        A tenant whose `release` is a list tries each step in order (each within its own timeout) until
        one gives the memory back; a stopping step stops the app, only while it is idle (invariant 7).
        `stop`: only the step that stops the app (the admin's stop), the soft ones before it skipped."""
        self.residency.forget(tenant.name)  # whatever it held is on its way off the card
        before = before or await self.snapshot()
        held_before = self.held(before, tenant.name)
        start = self.clock.now()
        steps = [(i, s) for i, s in enumerate(tenant.release_steps) if s.kind != "none" and (s.stops or not stop)]
        result = ReleaseResult(tenant.name, expected, 0, 0.0, False, "no release step")
        trail: list[dict[str, Any]] = []  # for a release that escalates: what each step freed
        held = held_before
        for i, step in steps:
            result = await self._release_step(tenant, step, expected, held_before, held)
            after = held_before - result.freed_bytes
            trail.append({"step": i, "kind": step.kind, "freed_bytes": max(0, held - after),
                          "duration_s": round(result.duration_s, 3), "result": result.result, "error": result.error})
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
                            held_now: int) -> ReleaseResult:
        """One step: ask (or stop the app), then watch the card until the tenant is down to its target."""
        stops = step.stops
        target = 0 if stops else max(held_before - expected, 0)
        began = self.clock.now()
        try:
            if stops:
                report = await self.lifecycles.stop(tenant, lambda: self.stop_blocked(tenant.name))
                asked: dict[str, object] = {"stop": report.to_json()}
                if not report.ok:
                    return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - began, False,
                                         report.error, asked, busy=report.refused and report.state == "running")
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
        every request that wakes it and the admin's start."""
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
        admitted = await self.queue.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            await self.lifecycles.wake(tenant)
        finally:
            self.settle(admitted.handoff)  # it is up: what it loaded is on the card, measured from now
        return admitted

    async def start(self, tenant: Tenant, trigger: str) -> Admitted | LifecycleReport:
        """The admin's start of a tenant the proxy starts: room is made for it exactly as for a request
        that wakes it (`wake`), then it is started, past any backoff after a failed start (an explicit
        ask), sharing a start under way. The queue's refusal or timeout (an Admitted that is not
        "run"), or the start's report (ok, or failed with the reason and the app's last lines)."""
        need = self.start_need(tenant)
        admitted = await self.queue.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            return await self.lifecycles.start(tenant, force=True)
        finally:
            self.settle(admitted.handoff)  # it is up (or failed): what it holds is measured from now

    # -- the handoff queue's effects (HandoffEffects) -------------------------------------------
    async def read(self) -> tuple[AttributedSnapshot, dict[str, TenantState], dict[str, tuple[str, int]]]:
        # No wait for a release under way: the scheduler knows which are (`HandoffQueue.releasing`).
        snap = await self.snapshot()
        return snap, self.states(snap), self.promised(snap)

    async def carry_out(self, order: ReleaseOrder) -> Released:
        """The effect behind `HandoffQueue.release`, the one release path: under the handoff lock,
        log the order, release each tenant that is still idle (invariant 5: a busy one is never
        released) and wait for the card to show the memory back. Run as a task, so a release is
        never cut half way by a client leaving and the scheduler never waits for it."""
        contended = self.handoff_lock.locked()
        async with self.handoff_lock:
            snap = order.snapshot
            if snap is None or contended:  # the card may have changed while another release ran
                snap = await self.snapshot()
            states = self.states(snap)  # the rule the plan was made with, so a stale job never loops
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
            results = [await self.execute_release(self.registry.get(r.tenant), r.expected_free_bytes, snap,
                                                  stop=order.stop)
                       for r in todo]
            self.decisions.emit(HandoffFinished(kind=order.kind, tenant=order.requester, trigger=order.trigger,
                                                refers_to=started.id, releases=tuple(results)))
        return Released(order, [*results, *skipped], started)

    def reserve(self, key: str, handoff: Handoff) -> None:
        plan = handoff.plan
        r = self._reservations.get(key)
        if r:
            r.count += 1
        else:
            net = max(0, plan.need_bytes - plan.held_by_requester)
            self._reservations[key] = _Reservation(plan.requester, net, plan.held_by_requester, device=plan.device)
        handoff.reservation = key

    def abandon(self, handoff: Handoff) -> None:
        self.settle(handoff)

    def prepare_load(self, tenant: str, model: str) -> None:
        if self.load_hooks is not None:
            self.load_hooks.prepare_load(tenant, model)

    def admit_work(self, work: Token) -> None:
        self.inflight.admit(work)

    def resident(self, tenant: str, key: str) -> bool:
        r = self._reservations.get(key)
        return self.residency.holds(tenant, key) or (r is not None and r.tenant == tenant)

    # -- the request path ---------------------------------------------------------------------
    async def admit(self, tenant: Tenant, path: str, body: bytes, trigger: str,
                    *, oom: bool = False, work: Token | None = None) -> tuple[Admitted, Need]:
        """Make room for a GPU request: at once when its load is already on the card (the scheduler's
        own first step, `HandoffQueue.admit_at_once`), else through the handoff queue (which may
        wait for busy tenants, up to the queue timeout). `work`: the request's traffic token, counted
        as the tenant's work from its admission on. A client that goes away while waiting leaves the
        queue."""
        need = await self.adapter(tenant).estimate_need(path, body, self.control)
        need_bytes = need.bytes
        if oom:
            self.residency.forget(tenant.name)
            snap = self.last_snapshot or await self.snapshot()
            need_bytes = max(need_bytes, self.held(snap, tenant.name) + devices.free_for(snap, tenant.name) + OOM_HEADROOM_BYTES)
        elif (at_once := self.queue.admit_at_once(tenant, need.key, need_bytes, work)) is not None:
            return at_once, need
        admitted = await self.queue.request(tenant, need.key, need_bytes, trigger, "oom_retry" if oom else "plan",
                                            model=need.model, work=work)
        return admitted, need

    def settle(self, handoff: Handoff | None) -> None:
        """The admitted request reached the engine (or gave up): its reservation ends. Idempotent,
        and only ever the handoff's own, so it never eats another request's reservation."""
        if handoff is not None and handoff.reservation is not None:
            self._unreserve(handoff.reservation)
            handoff.reservation = None
            self.queue.kick()

    def settle_when_idle(self, handoff: Handoff | None) -> None:
        """For a job that outlives its HTTP answer (a ComfyUI prompt loads after `POST /prompt`
        returns): the reservation lasts until the tenant has nothing running any more."""
        if handoff is None or handoff.reservation is None:
            return
        task = asyncio.create_task(self._settle_when_idle(handoff), name="hyperswap:settle")
        self._settlers.add(task)
        task.add_done_callback(self._settlers.discard)

    async def _settle_when_idle(self, handoff: Handoff) -> None:
        try:
            await self.inflight.wait_idle(handoff.plan.requester)
        finally:
            self.settle(handoff)

    async def aclose(self) -> None:
        await self.queue.aclose()
        await self.lifecycles.aclose()
        for task in list(self._settlers):
            task.cancel()
        await asyncio.gather(*self._settlers, return_exceptions=True)
        await self.control.aclose()

    def _unreserve(self, key: str) -> None:
        r = self._reservations.get(key)
        if r:
            r.count -= 1
            if r.count <= 0:
                del self._reservations[key]
