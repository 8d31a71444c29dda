"""The request path: classify -> estimate -> queue for memory -> forward -> OOM retry.

`Arbitration` owns the effects of a handoff: GPU snapshots one at a time off the loop, busy states,
reservations for loads that were admitted but have not reached the card yet, releases confirmed on
the card, the decision log. Who runs, waits or is refused is decided by the pure
`arbiter.schedule`, driven by the `HandoffQueue`; a load already on the card skips the queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.clock import Clock
from proxy.engines import AdapterCache, EngineAdapter, Need, ReleaseFailed, strip_hop_by_hop
from proxy.engines.base import JobReplay
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot, Attributor
from proxy.gpu.devices import DevicePlacer
from proxy.gpu.snapshot import DeviceFigure, DeviceMemory, GpuProcess, GpuReader, GpuReadError, GpuSnapshot
from proxy.handoff import devices
from proxy.handoff.arbiter import Plan, PlanMode, TenantState, gib, promised_by_tenant, unplanned_plan
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.inflight import InFlight, TenantTraffic
from proxy.handoff.queue import Admitted, Handoff, HandoffQueue, ReleaseResult
from proxy.handoff.residency import Residency
from proxy.tenants import GIB, MIB, Registry, Tenant
from proxy.tls import client_context

if TYPE_CHECKING:
    from proxy.relay.forward import UpstreamResponse

log = logging.getLogger("hyperswap.admission")

CONFIRM_SLACK_BYTES = 64 * MIB  # a release is confirmed when the tenant is within this of its target
OOM_HEADROOM_BYTES = 1 * GIB  # after an OOM the estimate was wrong: ask for this much more than is free
# A job the proxy relayed counts as busy at once, before its load reaches the card; after this long
# with the tenant's VRAM still at its idle floor it is believed stale (invariant 3).
JOB_LOAD_GRACE_S = 30.0

__all__ = ["Admitted", "Arbitration", "GpuAdmission", "Handoff", "ReleaseResult", "gib"]


@dataclass(slots=True)
class _Reservation:
    tenant: str
    need: int  # net: what the load adds to what the tenant held when admitted
    baseline: int  # what the tenant held when admitted; growth above it means the load arrived
    count: int = 1
    device: int | None = None  # the card it was admitted on, on a host with several


class LoadHooks(Protocol):
    """What the model-files extension does around a load (proxy/admin/models_api.py). Never blocks."""

    def prepare_load(self, tenant: str, model: str) -> None:
        """Memory is about to be released (or waited for) for this load: warm its files meanwhile."""

    async def loading(self, tenant: Tenant, model: str, body: bytes) -> Callable[[UpstreamResponse], UpstreamResponse] | None:
        """Just before forwarding a load (its residency is read now): a wrapper for the engine's answer
        that times it, or None."""

    def on_frame(self, tenant: Tenant, text: str) -> None:
        """Every upstream websocket text frame (ComfyUI's execution frames time its checkpoint loads)."""


@dataclass(frozen=True, slots=True)
class _QueueRead:
    started_at: float  # monotonic time the engine's queue read began
    job_ids: tuple[str, ...]


class Arbitration:
    def __init__(self, registry: Registry, reader: GpuReader, inflight: InFlight, clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient | None = None,
                 adapter: Callable[[Tenant], EngineAdapter] | None = None) -> None:
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
        self.started_at = clock.now()  # idle deadlines of tenants never seen active count from here
        self.handoff_lock = asyncio.Lock()  # releases, one at a time: the queue, the watchdog, the admin API
        self._snapshot_lock = asyncio.Lock()
        self._reservations: dict[str, _Reservation] = {}
        self._settlers: set[asyncio.Task[None]] = set()
        self.last_snapshot: AttributedSnapshot | None = None
        self.last_read_error: GpuReadError | None = None
        self._measured_device: DeviceMemory | None = None  # the last device figures a reader measured
        self.stale_jobs: dict[str, list[str]] = {}  # tenant -> job ids whose VRAM says they are not running
        self._queue_reads: dict[str, _QueueRead] = {}  # tenant -> jobs its own queue said run (watchdog reads it)
        self.load_hooks: LoadHooks | None = None  # set by the model-files extension
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
        """What the engine's own queue said was running, read from `started_at` (None: unreadable)."""
        if job_ids is None:
            self._queue_reads.pop(tenant, None)
        else:
            self._queue_reads[tenant] = _QueueRead(started_at, job_ids)

    def _queue_rows(self, tenant: str, traffic: TenantTraffic | None) -> tuple[str, ...]:
        """Rows of the engine's queue still worth believing: read after the proxy last saw the
        tenant's traffic change (an older read may predate the end marker), minus jobs the proxy
        saw end."""
        read = self._queue_reads.get(tenant)
        if read is None:
            return ()
        if traffic is not None and traffic.last_activity is not None and read.started_at < traffic.last_activity:
            return ()
        return tuple(j for j in read.job_ids if not self.inflight.finished(tenant, j))

    def states(self, snap: AttributedSnapshot) -> dict[str, TenantState]:
        """Busy = requests in flight, jobs the proxy relayed (trusted while their load may still be
        on its way, then corroborated by VRAM), or rows of the engine's own queue corroborated by
        the tenant's VRAM above its idle floor (invariant 3)."""
        traffic = self.inflight.snapshot()
        now = self.clock.now()
        out: dict[str, TenantState] = {}
        stale: dict[str, list[str]] = {}
        for tenant in self.registry:
            t = traffic.get(tenant.name)
            in_flight = t.in_flight if t else 0
            own = t.jobs if t else ()
            rows = tuple(j for j in self._queue_rows(tenant.name, t) if j not in own)
            above_floor = self.held(snap, tenant.name) > tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES
            fresh = own and (t is not None and t.newest_job_at is not None and now - t.newest_job_at < JOB_LOAD_GRACE_S)
            busy, why = False, "idle"
            if in_flight:
                busy, why = True, f"{in_flight} GPU request(s) in flight"
            elif own and (above_floor or fresh):
                busy, why = True, f"{len(own)} running job(s)" + ("" if above_floor else ", load on its way")
            elif rows and above_floor:
                busy, why = True, f"{len(rows)} job(s) in its own queue and VRAM above its idle floor"
            elif own or rows:
                stale[tenant.name] = list(dict.fromkeys((*own, *rows)))
                why = f"{len(stale[tenant.name])} job(s) listed but VRAM at its idle floor: stale"
            out[tenant.name] = TenantState(name=tenant.name, busy=busy, busy_reason=why, in_flight=in_flight)
        self.stale_jobs = stale
        return out

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

    async def execute_release(self, tenant: Tenant, expected: int, before: AttributedSnapshot | None = None) -> ReleaseResult:
        """Ask, then confirm on the GPU: done when the memory is back, never on the engine's 200 (invariant 6)."""
        self.residency.forget(tenant.name)  # whatever it held is on its way off the card
        before = before or await self.snapshot()
        held_before = self.held(before, tenant.name)
        target = max(held_before - expected, 0)
        start = self.clock.now()
        try:
            asked = await self.adapter(tenant).release(self.control)
        except ReleaseFailed as exc:
            return ReleaseResult(tenant.name, expected, 0, self.clock.now() - start, False, str(exc))
        deadline = start + tenant.release_timeout_s
        held_now = held_before
        while True:
            snap = await self.snapshot()
            held_now = self.held(snap, tenant.name)
            if held_now <= target + CONFIRM_SLACK_BYTES:  # on the engines' reports alone it is an estimate
                return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - start,
                                     not snap.estimated, asked=asked, estimated=snap.estimated)
            if self.clock.now() >= deadline:
                return ReleaseResult(tenant.name, expected, max(0, held_before - held_now), self.clock.now() - start, False,
                                     f"memory not back after {tenant.release_timeout_s:g} s", asked, snap.estimated,
                                     timed_out=True)
            await self.clock.sleep(self.registry.config.proxy.release_poll_s)

    # -- the handoff queue's effects (HandoffEffects) -------------------------------------------
    async def read(self) -> tuple[AttributedSnapshot, dict[str, TenantState], dict[str, tuple[str, int]]]:
        # No wait for a release under way (the watchdog's, the admin's): a request that needs no
        # release runs now; one that does waits for the lock in carry_out.
        snap = await self.snapshot()
        return snap, self.states(snap), self.promised(snap)

    async def carry_out(self, plan: Plan, snap: AttributedSnapshot, trigger: str, kind: str) -> Handoff:
        """Record the plan, run its releases under the handoff lock, record how they went. The queue
        calls it from its own task (a release is never cut half way by a client leaving), the
        watchdog for a spill's relief."""
        async with self.handoff_lock:
            decision = self.decisions.record(kind, plan.requester, trigger, plan.to_json())  # type: ignore[arg-type]
            results = [await self.execute_release(self.registry.get(r.tenant), r.expected_free_bytes, snap)
                       for r in plan.releases]
            self.decisions.update(decision, releases=[r.to_json() for r in results],
                                  ok=all(r.confirmed for r in results))
        return Handoff(plan, results, decision, snap)

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

    # -- the request path ---------------------------------------------------------------------
    async def admit(self, tenant: Tenant, request: Request | None, body: bytes, trigger: str,
                    *, oom: bool = False) -> tuple[Admitted, Need]:
        """Make room for a GPU request: straight through when its load is already on the card and
        nobody waits, else through the handoff queue (which may wait for busy tenants, up to the
        queue timeout). A client that goes away while waiting leaves the queue."""
        need = await self.adapter(tenant).estimate_need(request.url.path if request else "", body, self.control)
        need_bytes = need.bytes
        if oom:
            self.residency.forget(tenant.name)
            snap = self.last_snapshot or await self.snapshot()
            need_bytes = max(need_bytes, self.held(snap, tenant.name) + devices.free_for(snap, tenant.name) + OOM_HEADROOM_BYTES)
        elif self.queue.empty and self.residency.holds(tenant.name, need.key):
            plan = Plan(tenant.name, need_bytes, 0, 0, True, False, (), (),
                        f"{need.what} is on the card already: forwarded without a plan", False)
            return Admitted("run", Handoff(plan, [], None), "resident"), need
        admitted = await self.queue.request(tenant, need.key, need_bytes, trigger, "oom_retry" if oom else "plan",
                                            model=need.model)
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


def blockers_json(handoff: Handoff) -> list[dict[str, Any]]:
    snap = handoff.snapshot
    out = []
    for b in handoff.plan.blockers:
        proc = snap.snapshot.process(b.pid) if snap is not None and b.pid is not None else None
        out.append({"pid": b.pid, "name": b.name, "cmdline": proc.cmdline if proc else "", "tenant": b.tenant,
                    "vram_gb": gib(b.vram_bytes), "reason": b.reason, "detail": b.detail})
    return out


def _refusal_fix(handoff: Handoff) -> str:
    reasons = {b.reason for b in handoff.plan.blockers}
    device = devices.device(handoff.snapshot, handoff.plan.device) if handoff.snapshot else None
    if device is not None and device.total_bytes and handoff.plan.need_bytes > device.total_bytes - device.reserved_bytes:
        return "use a smaller model or quantisation: no release on this card can free that much"
    fixes = []
    if "unmanaged" in reasons:
        fixes.append("stop the unmanaged processes named in blockers, or register them as a tenant with a release")
    if "not_reclaimable" in reasons:
        fixes.append("give the not-reclaimable tenants a release in tenants.json, or stop them")
    if "protected" in reasons:
        fixes.append("raise this tenant's priority, or unset protect_idle_memory on the protected tenant")
    return "; ".join(fixes) or "free GPU memory held outside the proxy's tenants, or ask for less"


def rejection_body(tenant: Tenant, handoff: Handoff, need: Need) -> dict[str, Any]:
    """507: the need cannot be met even once every busy tenant finished and every reclaimable one
    were released."""
    plan = handoff.plan
    body: dict[str, Any] = {
        "error": f"not enough GPU memory for {tenant.name}: {plan.explanation}",
        "tenant": tenant.name,
        "need_gb": gib(need.bytes),
        "available_gb": gib(plan.reachable_bytes),
        "blockers": blockers_json(handoff),
        "plan": plan.to_json(),
        "fix": _refusal_fix(handoff),
    }
    if plan.device is not None and handoff.snapshot is not None:  # a host with several cards: which one
        dev = devices.device(handoff.snapshot, plan.device)
        body["device"] = {"index": dev.index, "name": dev.name, "uuid": dev.uuid}
    return body


def timeout_response(tenant: Tenant, admitted: Admitted, timeout_s: float) -> JSONResponse:
    """503 past `proxy.queue_timeout_s`: waiting could still help, so say when to come back."""
    handoff = admitted.handoff
    retry_after = max(1, int(min(timeout_s, 30)))
    body = {"error": f"{tenant.name} waited {timeout_s:g} s for GPU memory: {admitted.reason}",
            "tenant": tenant.name, "waited_s": round(handoff.waited_s, 3),
            "waiting_for": list(handoff.plan.wait_for), "blockers": blockers_json(handoff),
            "plan": handoff.plan.to_json(),
            "fix": "retry after the busy tenants finish (Retry-After), or raise proxy.queue_timeout_s in tenants.json"}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry_after)})


class GpuAdmission:
    """The listener's hook for GPU requests: admit, forward, and on an OOM answer reclaim and retry once.

    Ollama's OOM is an HTTP answer: the kept body is replayed. ComfyUI's arrives later, as an
    `execution_error` frame on a websocket passing through the proxy, or (for a client with no
    websocket) in the /history entry the job poller reads: the same graph is re-queued for the same
    client_id, read back from ComfyUI's own /history entry.
    """

    def __init__(self, arbitration: Arbitration, adapter: Callable[[Tenant], EngineAdapter] | None = None) -> None:
        self.arb = arbitration
        self._adapter = adapter or arbitration.adapter  # the forwarder's per-tenant adapters
        self._requeued: dict[str, str] = {}  # new prompt id -> the OOM'd prompt it retries
        self._seen_oom: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def on_frame(self, tenant: Tenant, text: str) -> None:
        """Called for every upstream text frame of a tenant's websockets (the adapter filters cheaply first)."""
        if self.arb.load_hooks is not None:
            self.arb.load_hooks.on_frame(tenant, text)
        job_id = self._adapter(tenant).oom_job_from_frame(text)
        if job_id is not None:
            self._oom(tenant, job_id)

    def on_job_end(self, tenant: Tenant, job_id: str, history: bytes) -> None:
        """A prompt's end found by the history poll (its client never opened a websocket, so no
        frame told us): the engine's history entry says whether it ran out of memory."""
        if self._adapter(tenant).oom_in_history(job_id, history):
            self._oom(tenant, job_id)

    def on_job_lost(self, tenant: Tenant, job_id: str) -> None:
        self.arb.decisions.record("stale_job", tenant.name, "job reconciliation", None, job_id=job_id,
                                  reason=f"{job_id} is in neither {tenant.name}'s queue nor its history (deleted from "
                                         "the queue, or the engine restarted): no longer counted as running")
        self.arb.queue.kick()

    def _oom(self, tenant: Tenant, prompt_id: str) -> None:
        if self._closed or not prompt_id or prompt_id in self._seen_oom:
            return  # several sockets, or a socket and the history poll, can report the same OOM
        self._seen_oom.add(prompt_id)
        if len(self._seen_oom) > 4096:
            self._seen_oom.pop()
        task = asyncio.create_task(self._retry_prompt(tenant, prompt_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry_prompt(self, tenant: Tenant, prompt_id: str) -> None:
        if prompt_id in self._requeued:
            self.arb.decisions.record("oom_retry", tenant.name, f"second OOM of prompt {self._requeued[prompt_id]}",
                                      None, result="failed", prompt_id=prompt_id)
            return
        adapter = self._adapter(tenant)
        replay = await self._job_replay(adapter, prompt_id)
        if replay is None:
            self.arb.decisions.record("oom_retry", tenant.name, f"OOM of prompt {prompt_id}", None,
                                      result="not retried: prompt not in ComfyUI's history")
            return
        admitted, _need = await self.arb.admit(tenant, None, replay.body, f"OOM of ComfyUI prompt {prompt_id}", oom=True)
        handoff = admitted.handoff
        try:
            if admitted.outcome != "run" or not handoff.plan.feasible or not handoff.plan.starved:
                self._record_retry(tenant, handoff, "no plan")
                return
            new_id, status = await adapter.resubmit(self.arb.control, replay)
            if not new_id:
                self._record_retry(tenant, handoff, f"re-queue refused: {status}")
                return
            self._requeued[new_id] = prompt_id
            self.arb.inflight.track_job(tenant.name, new_id)
            self._record_retry(tenant, handoff, "requeued")
            if handoff.decision is not None:
                self.arb.decisions.update(handoff.decision, requeued_as=new_id, prompt_id=prompt_id)
        except (httpx.HTTPError, ValueError, ReleaseFailed) as exc:
            self._record_retry(tenant, handoff, f"re-queue failed: {exc}")
        finally:
            self.arb.settle_when_idle(handoff)  # the re-queued prompt loads after POST /prompt returns

    async def _job_replay(self, adapter: EngineAdapter, job_id: str) -> JobReplay | None:
        """The engine writes the failed job down shortly after its error frame: look for a while."""
        for _ in range(50):
            replay = await adapter.job_replay(self.arb.control, job_id)
            if replay is not None:
                return replay
            await self.arb.clock.sleep(0.1)
        return None

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def handle(self, tenant: Tenant, request: Request, body: bytes,
                     forward: Callable[[bytes], Awaitable[UpstreamResponse]]) -> UpstreamResponse | Response:
        adapter = self._adapter(tenant)
        unloading = adapter.unload_target(request.url.path, body)
        if unloading is not None:
            # An unload loads nothing: it needs no memory, releases nobody and is never refused.
            self.arb.residency.forget(tenant.name, adapter.load_key(unloading))
            return await forward(body)
        trigger = f"request {request.method} {request.url.path}"
        admitted, need = await self.arb.admit(tenant, request, body, trigger)
        handoff = admitted.handoff
        retry: Handoff | None = None
        outlives = adapter.captures_job(request.method, request.url.path)
        if admitted.outcome == "timeout":
            self.arb.decisions.record("rejection", tenant.name, trigger, handoff.plan.to_json(), status=503,
                                      reason=admitted.reason)
            return timeout_response(tenant, admitted, self.arb.registry.config.proxy.queue_timeout_s)
        if admitted.outcome == "refuse":
            return JSONResponse(rejection_body(tenant, handoff, need), status_code=507)
        hooks = self.arb.load_hooks
        loads = need.model is not None and admitted.reason != "resident"  # on the card already: nothing to time
        watch = await hooks.loading(tenant, need.model, body) if hooks is not None and need.model and loads else None
        try:
            response = await forward(body)
            if response.status_code < 400:
                self.arb.residency.loaded(tenant.name, need.key)
                if watch is not None:
                    response = watch(response)  # reads the engine's own load time as the answer passes
            if not adapter.answers_oom or response.status_code < 400:
                return response
            error_body = await response.aread()
            await response.aclose()
            if not adapter.response_is_oom(response.status_code, error_body):
                return _replay_response(response, error_body)
            # The first try is over: its reservation goes before the retry reserves its bigger need
            # (under the same key it would only have counted once more, with the old size and baseline).
            self.arb.settle(handoff)
            again, _ = await self.arb.admit(tenant, request, body, f"OOM answer to {trigger}", oom=True)
            retry = again.handoff
            outcome = ("no plan" if again.outcome != "run" or not retry.plan.feasible or not retry.plan.starved
                       else "retried")
            if outcome == "retried":
                response = await forward(body)
                if response.status_code < 400:
                    self.arb.residency.loaded(tenant.name, need.key)
                    self._record_retry(tenant, retry, "succeeded")
                    return response
                error_body = await response.aread()
                await response.aclose()
            self._record_retry(tenant, retry, "failed" if outcome == "retried" else outcome)
            return _with_blockers(response, error_body, retry)
        finally:
            if outlives:
                self.arb.settle_when_idle(handoff)  # the job loads after the answer: keep its memory promised
            else:
                self.arb.settle(handoff)
            self.arb.settle(retry)

    def _record_retry(self, tenant: Tenant, handoff: Handoff | None, result: str) -> None:
        if handoff is not None and handoff.decision is not None:
            self.arb.decisions.update(handoff.decision, oom_retry=result)
        else:
            self.arb.decisions.record("oom_retry", tenant.name, "OOM answer", None, result=result)


def _replay_response(upstream: UpstreamResponse, body: bytes) -> Response:
    """The upstream's answer, already read, as it was: repeated headers kept, framing re-done."""
    response = Response(body, status_code=upstream.status_code)
    length = (b"content-length", b"%d" % len(body))
    headers = [length if k == b"content-length" else (k, v) for k, v in strip_hop_by_hop(upstream.raw_headers)]
    response.raw_headers = headers if length in headers else [*headers, length]  # order kept, as the engine sent it
    return response


def _with_blockers(upstream: UpstreamResponse, body: bytes, handoff: Handoff | None) -> Response:
    try:
        data = json.loads(body)
    except ValueError:
        return _replay_response(upstream, body)
    if isinstance(data, dict) and handoff is not None:
        data["blockers"] = blockers_json(handoff)
        data["plan"] = handoff.plan.to_json()
    return JSONResponse(data, status_code=upstream.status_code)
