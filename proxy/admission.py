"""The request path: classify -> estimate -> plan -> execute releases -> forward -> OOM retry.

`Arbitration` owns the handoff: one at a time per device (an asyncio lock), GPU snapshots one at a
time off the loop, reservations for loads that were admitted but have not reached the card yet, and
the decision log. Plans come from the pure `arbiter.plan_release`; this module only does effects.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .arbiter import Plan, TenantState, plan_release
from .attribution import AttributedProcess, AttributedSnapshot, Attributor
from .clock import Clock
from .decisions import Decision, DecisionLog
from .engines import memory, strip_hop_by_hop
from .gpu import DeviceMemory, GpuProcess, GpuReader, GpuReadError, GpuSnapshot
from .inflight import InFlight
from .tenants import GIB, MIB, Registry, Tenant

if TYPE_CHECKING:
    from .forward import UpstreamResponse

log = logging.getLogger("hyperswap.admission")

CONFIRM_SLACK_BYTES = 64 * MIB  # a release is confirmed when the tenant is within this of its target
OOM_HEADROOM_BYTES = 1 * GIB  # after an OOM the estimate was wrong: ask for this much more than is free


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


@dataclass(slots=True)
class ReleaseResult:
    tenant: str
    expected_bytes: int
    freed_bytes: int
    duration_s: float
    confirmed: bool
    error: str | None = None
    asked: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "expected_bytes": self.expected_bytes, "freed_bytes": self.freed_bytes,
                "expected_gb": gib(self.expected_bytes), "freed_gb": gib(self.freed_bytes),
                "duration_s": round(self.duration_s, 3), "confirmed": self.confirmed, "error": self.error,
                "asked": self.asked}


@dataclass(slots=True)
class Handoff:
    plan: Plan
    releases: list[ReleaseResult]
    decision: Decision | None
    snapshot: AttributedSnapshot | None = None
    reservation: str | None = None  # the key memory was reserved under; `Arbitration.settle` gives it back

    @property
    def ok(self) -> bool:
        return self.plan.feasible and all(r.confirmed for r in self.releases)


@dataclass(slots=True)
class _Reservation:
    tenant: str
    need: int
    baseline: int  # what the tenant held when admitted; growth above it means the load arrived
    count: int = 1


class Arbitration:
    def __init__(self, registry: Registry, reader: GpuReader, inflight: InFlight, clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient | None = None) -> None:
        self.registry = registry
        self.reader = reader
        self.attributor = Attributor(registry)
        self.inflight = inflight
        self.clock = clock
        self.decisions = decisions
        self.control = control or httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)
        self.catalog = memory.OllamaCatalog()
        self.started_at = clock.now()  # idle deadlines of tenants never seen active count from here
        self.handoff_lock = asyncio.Lock()
        self._snapshot_lock = asyncio.Lock()
        self._reservations: dict[str, _Reservation] = {}
        self._handoffs: set[asyncio.Future[Handoff]] = set()  # running on after their client left
        self.last_snapshot: AttributedSnapshot | None = None
        self.last_read_error: GpuReadError | None = None
        self.stale_jobs: dict[str, list[str]] = {}  # tenant -> job ids whose VRAM says they are not running
        self.queued_elsewhere: dict[str, tuple[str, ...]] = {}  # tenant -> jobs its own queue says run (watchdog reads it)

    # -- reading the card ---------------------------------------------------------------------
    async def snapshot(self) -> AttributedSnapshot:
        """One GPU read at a time, off the loop. A broken reader falls back to the engines' own reports."""
        async with self._snapshot_lock:
            try:
                snap = self.attributor.attribute(await asyncio.to_thread(self.reader.read))
                self.last_read_error = None
            except Exception as exc:  # a failing reader never stops traffic (invariant 10)
                self.last_read_error = exc if isinstance(exc, GpuReadError) else GpuReadError(
                    "unknown", f"GPU read failed: {exc!r}", "run `hyperswap check`")
                snap = await self._engine_estimate()
            self.last_snapshot = snap
            return snap

    async def _engine_estimate(self) -> AttributedSnapshot:
        """What the engines say about themselves, marked as an estimate (invariant 10).

        ComfyUI's /system_stats carries device-wide total and free (cudaMemGetInfo); without it
        the last good reading's total is used, and with neither the total is unknown (0)."""
        procs: list[AttributedProcess] = []
        device: DeviceMemory | None = None
        for i, tenant in enumerate(self.registry):
            if not tenant.upstream:
                continue
            held = await memory.self_reported_bytes(tenant, self.control)
            if held is not None:
                proc = GpuProcess(pid=-(i + 1), name=f"[{tenant.name} self-report]", cmdline="", used_bytes=held)
                procs.append(AttributedProcess(proc, tenant.name))
            if device is None and tenant.engine == "comfyui":
                device = await memory.comfy_device(tenant, self.control)
        if device is None:
            prev = self.last_snapshot.snapshot.device if self.last_snapshot else None
            total = prev.total_bytes if prev and self.last_snapshot and not self.last_snapshot.estimated else 0
            used = sum(p.process.used_bytes or 0 for p in procs)
            device = DeviceMemory(0, prev.name if prev else "unknown (GPU reader failed)", total, 0, used,
                                  max(0, total - used))
        raw = GpuSnapshot(device, tuple(p.process for p in procs), source="engine-estimate", taken_at=self.clock.now(),
                          notes=("GPU reader failed: memory figures are the engines' own estimates",))
        return AttributedSnapshot(raw, tuple(procs))

    def held(self, snap: AttributedSnapshot, tenant: str) -> int:
        return snap.held_by(tenant)

    # -- busy ---------------------------------------------------------------------------------
    def states(self, snap: AttributedSnapshot) -> dict[str, TenantState]:
        """Busy = requests in flight, or queued jobs corroborated by the tenant's own VRAM (invariant 3)."""
        traffic = self.inflight.snapshot()
        out: dict[str, TenantState] = {}
        stale: dict[str, list[str]] = {}
        for tenant in self.registry:
            t = traffic.get(tenant.name)
            in_flight = t.in_flight if t else 0
            jobs = tuple(dict.fromkeys((*(t.jobs if t else ()), *self.queued_elsewhere.get(tenant.name, ()))))
            busy, why = False, "idle"
            if in_flight:
                busy, why = True, f"{in_flight} GPU request(s) in flight"
            elif jobs:
                if self.held(snap, tenant.name) > tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES:
                    busy, why = True, f"{len(jobs)} queued job(s) and VRAM above its idle floor"
                else:
                    stale[tenant.name] = list(jobs)
                    why = f"{len(jobs)} job(s) listed but VRAM at its idle floor: stale"
            out[tenant.name] = TenantState(name=tenant.name, busy=busy, busy_reason=why, in_flight=in_flight)
        self.stale_jobs = stale
        return out

    # -- planning -----------------------------------------------------------------------------
    def _outstanding(self, snap: AttributedSnapshot, except_key: str) -> int:
        """Memory promised to admitted loads that have not reached the card yet."""
        total = 0
        for key, r in self._reservations.items():
            if key != except_key:
                total += max(0, r.need - max(0, self.held(snap, r.tenant) - r.baseline))
        return total

    async def plan(self, requester: str, need_bytes: int, key: str = "",
                   snap: AttributedSnapshot | None = None) -> tuple[Plan, AttributedSnapshot]:
        self.registry.get(requester)
        snap = snap or await self.snapshot()
        extra = self._outstanding(snap, key or requester)
        plan = plan_release(snap, self.registry, self.states(snap), requester, need_bytes + extra)
        return plan, snap

    async def reclaim(self, requester: str, need_bytes: int, trigger: str, *, key: str = "",
                      kind: str = "plan", snap: AttributedSnapshot | None = None) -> Handoff:
        """Plan and, if needed and possible, execute. Callers hold `handoff_lock`."""
        plan, snap = await self.plan(requester, need_bytes, key, snap)
        if not plan.starved:
            return Handoff(plan, [], None, snap)
        decision = self.decisions.record("rejection" if not plan.feasible else kind, requester, trigger, plan.to_json())  # type: ignore[arg-type]
        if not plan.feasible:
            return Handoff(plan, [], decision, snap)
        results = [await self.execute_release(self.registry.get(r.tenant), r.expected_free_bytes, snap)
                   for r in plan.releases]
        self.decisions.update(decision, releases=[r.to_json() for r in results],
                              ok=all(r.confirmed for r in results))
        return Handoff(plan, results, decision, snap)

    async def execute_release(self, tenant: Tenant, expected: int, before: AttributedSnapshot | None = None) -> ReleaseResult:
        """Ask, then confirm on the GPU: done when the memory is back, never on the engine's 200 (invariant 6)."""
        before = before or await self.snapshot()
        held_before = self.held(before, tenant.name)
        target = max(held_before - expected, 0)
        start = self.clock.now()
        try:
            asked = await memory.release(tenant, self.control)
        except memory.ReleaseFailed as exc:
            return ReleaseResult(tenant.name, expected, 0, self.clock.now() - start, False, str(exc))
        deadline = start + tenant.release_timeout_s
        held_now = held_before
        while True:
            snap = await self.snapshot()
            held_now = self.held(snap, tenant.name)
            if held_now <= target + CONFIRM_SLACK_BYTES:
                return ReleaseResult(tenant.name, expected, held_before - held_now, self.clock.now() - start, True, asked=asked)
            if self.clock.now() >= deadline:
                return ReleaseResult(tenant.name, expected, max(0, held_before - held_now), self.clock.now() - start, False,
                                     f"memory not back after {tenant.release_timeout_s:g} s", asked)
            await self.clock.sleep(self.registry.config.proxy.release_poll_s)

    # -- the request path ---------------------------------------------------------------------
    async def admit(self, tenant: Tenant, request: Request | None, body: bytes, trigger: str,
                    *, oom: bool = False) -> tuple[Handoff | None, memory.Need]:
        """Make room for a GPU request. Waits for a handoff in progress (no 503) up to the queue
        timeout; a client that goes away while waiting leaves the queue (the listener cancels its task)."""
        need = await memory.estimate_need(tenant, request.url.path if request else "", body, self.control, self.catalog)
        need_bytes = need.bytes
        if oom:
            snap = self.last_snapshot or await self.snapshot()
            need_bytes = max(need_bytes, self.held(snap, tenant.name) + snap.snapshot.free_bytes + OOM_HEADROOM_BYTES)
        if not await _acquire(self.handoff_lock, self.registry.config.proxy.queue_timeout_s):
            return None, need
        # Once started, a handoff runs to its end even if the client leaves: a release stopped half
        # way would leave the other tenant between states and the decision log without its outcome.
        handoff = asyncio.ensure_future(self._handoff(tenant, need, need_bytes, trigger, oom))
        try:
            return await asyncio.shield(handoff), need
        except asyncio.CancelledError:
            self._handoffs.add(handoff)
            handoff.add_done_callback(self._abandoned)
            raise

    async def _handoff(self, tenant: Tenant, need: memory.Need, need_bytes: int, trigger: str,
                       oom: bool) -> Handoff:
        """Plan and release under `handoff_lock` (taken by the caller, released here)."""
        try:
            snap = await self.snapshot()
            if snap.snapshot.device.total_bytes == 0:
                # Nothing to plan with (reader broken, no engine reports the card): forward, never block.
                return Handoff(_unplanned(tenant.name, need_bytes), [], None, snap)
            handoff = await self.reclaim(tenant.name, need_bytes, trigger, key=need.key,
                                         kind="oom_retry" if oom else "plan", snap=snap)
            if handoff.plan.feasible:
                self._reserve(need.key, tenant.name, need_bytes, handoff)
            return handoff
        finally:
            self.handoff_lock.release()

    def _abandoned(self, done: asyncio.Future[Handoff]) -> None:
        """The client left during its handoff: give back the reservation nobody will use."""
        self._handoffs.discard(done)
        if done.cancelled():
            return
        if done.exception() is not None:
            log.error("handoff of a departed request failed: %r", done.exception())
        else:
            self.settle(done.result())

    def settle(self, handoff: Handoff | None) -> None:
        """The admitted request reached the engine (or gave up): its reservation ends. Idempotent,
        and only ever the handoff's own, so it never eats another request's reservation."""
        if handoff is not None and handoff.reservation is not None:
            self._unreserve(handoff.reservation)
            handoff.reservation = None

    async def aclose(self) -> None:
        # At shutdown a departed client's handoff is cut short: nobody is left to wait for it.
        while self._handoffs:
            pending = list(self._handoffs)
            for handoff in pending:
                handoff.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._handoffs.difference_update(pending)
        await self.control.aclose()

    def _reserve(self, key: str, tenant: str, need: int, handoff: Handoff) -> None:
        r = self._reservations.get(key)
        if r:
            r.count += 1
        else:
            self._reservations[key] = _Reservation(tenant, need, handoff.plan.held_by_requester)
        handoff.reservation = key

    def _unreserve(self, key: str) -> None:
        r = self._reservations.get(key)
        if r:
            r.count -= 1
            if r.count <= 0:
                del self._reservations[key]


async def _acquire(lock: asyncio.Lock, timeout: float) -> bool:
    """Wait up to `timeout` for the lock. Cancel-safe: Lock.acquire never keeps a lock it was
    cancelled on, so a client leaving the queue (its task cancelled) takes nothing with it."""
    try:
        async with asyncio.timeout(timeout):
            await lock.acquire()
    except TimeoutError:
        return False
    return True


def _unplanned(requester: str, need: int) -> Plan:
    return Plan(requester, need, 0, 0, True, False, (), (), "card size unknown (GPU reader failed): forwarded without a plan", True)


def blockers_json(handoff: Handoff) -> list[dict[str, Any]]:
    snap = handoff.snapshot
    out = []
    for b in handoff.plan.blockers:
        proc = snap.snapshot.process(b.pid) if snap is not None and b.pid is not None else None
        out.append({"pid": b.pid, "name": b.name, "cmdline": proc.cmdline if proc else "", "tenant": b.tenant,
                    "vram_gb": gib(b.vram_bytes), "reason": b.reason, "detail": b.detail})
    return out


def rejection_body(tenant: Tenant, handoff: Handoff, need: memory.Need) -> dict[str, Any]:
    plan = handoff.plan
    return {
        "error": f"not enough GPU memory for {tenant.name}: {plan.explanation}",
        "tenant": tenant.name,
        "need_gb": gib(need.bytes),
        "available_gb": gib(plan.free_bytes + plan.held_by_requester + sum(r.expected_free_bytes for r in plan.releases)),
        "blockers": blockers_json(handoff),
        "plan": plan.to_json(),
        "fix": "stop or release one of the blockers, or raise this tenant's priority in tenants.json",
    }


class GpuAdmission:
    """The listener's hook for GPU requests: admit, forward, and on an OOM answer reclaim and retry once.

    Ollama's OOM is an HTTP answer: the kept body is replayed. ComfyUI's arrives later, as an
    `execution_error` frame on a websocket passing through the proxy, or (for a client with no
    websocket) in the /history entry the job poller reads: the same graph is re-queued for the same
    client_id, read back from ComfyUI's own /history entry.
    """

    def __init__(self, arbitration: Arbitration) -> None:
        self.arb = arbitration
        self._requeued: dict[str, str] = {}  # new prompt id -> the OOM'd prompt it retries
        self._seen_oom: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def on_frame(self, tenant: Tenant, text: str) -> None:
        """Called for every upstream text frame of a tenant's websockets (cheap filter first)."""
        if "execution_error" not in text or "OutOfMemoryError" not in text:
            return
        try:
            event = json.loads(text)
        except ValueError:
            return
        if isinstance(event, dict) and memory.comfy_event_is_oom(event):
            self._oom(tenant, str((event.get("data") or {}).get("prompt_id", "")))

    def on_job_end(self, tenant: Tenant, job_id: str, history: bytes) -> None:
        """A prompt's end found by the history poll (its client never opened a websocket, so no
        frame told us): ComfyUI keeps the execution_error in the entry's status messages."""
        if b"execution_error" not in history or b"OutOfMemoryError" not in history:
            return
        try:
            entry = json.loads(history).get(job_id) or {}
            messages = entry.get("status", {}).get("messages") or []
        except (ValueError, AttributeError):
            return
        for message in messages:
            if (isinstance(message, list) and len(message) == 2 and isinstance(message[1], dict)
                    and memory.comfy_event_is_oom({"type": message[0], "data": message[1]})):
                self._oom(tenant, job_id)
                return

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
        entry = await self._history_entry(tenant, prompt_id)
        if entry is None:
            self.arb.decisions.record("oom_retry", tenant.name, f"OOM of prompt {prompt_id}", None,
                                      result="not retried: prompt not in ComfyUI's history")
            return
        graph, extra = entry
        body = json.dumps({"prompt": graph}).encode()
        handoff, need = await self.arb.admit(tenant, None, body, f"OOM of ComfyUI prompt {prompt_id}", oom=True)
        try:
            if handoff is None or not handoff.plan.feasible or not handoff.plan.starved:
                self._record_retry(tenant, handoff, "no plan")
                return
            payload: dict[str, Any] = {"prompt": graph, "extra_data": extra}
            if extra.get("client_id"):
                payload["client_id"] = extra["client_id"]
            r = await self.arb.control.post(f"{tenant.upstream}/prompt", json=payload)
            new_id = r.json().get("prompt_id") if r.status_code == 200 else None
            if not new_id:
                self._record_retry(tenant, handoff, f"re-queue refused: {r.status_code}")
                return
            self._requeued[new_id] = prompt_id
            self.arb.inflight.track_job(tenant.name, new_id)
            self._record_retry(tenant, handoff, "requeued")
            if handoff.decision is not None:
                self.arb.decisions.update(handoff.decision, requeued_as=new_id, prompt_id=prompt_id)
        except (httpx.HTTPError, ValueError) as exc:
            self._record_retry(tenant, handoff, f"re-queue failed: {exc}")
        finally:
            self.arb.settle(handoff)

    async def _history_entry(self, tenant: Tenant, prompt_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """ComfyUI writes history before its end marker; the error frame comes just before that."""
        for _ in range(50):
            try:
                r = await self.arb.control.get(f"{tenant.upstream}/history/{prompt_id}")
                item = r.json().get(prompt_id) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                item = None
            if isinstance(item, dict) and isinstance(item.get("prompt"), list) and len(item["prompt"]) >= 4:
                graph, extra = item["prompt"][2], item["prompt"][3]
                if isinstance(graph, dict) and isinstance(extra, dict):
                    return graph, extra
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
        trigger = f"request {request.method} {request.url.path}"
        handoff, need = await self.arb.admit(tenant, request, body, trigger)
        retry: Handoff | None = None
        if handoff is None:
            self.arb.decisions.record("rejection", tenant.name, trigger, None, status=503,
                                      reason=f"queue timeout ({self.arb.registry.config.proxy.queue_timeout_s:g} s)")
            return JSONResponse({"error": f"waited {self.arb.registry.config.proxy.queue_timeout_s:g} s for a GPU handoff in progress",
                                 "tenant": tenant.name, "fix": "retry, or raise proxy.queue_timeout_s"}, status_code=503)
        try:
            if not handoff.plan.feasible:
                return JSONResponse(rejection_body(tenant, handoff, need), status_code=507)
            response = await forward(body)
            if tenant.engine != "ollama" or response.status_code < 400:
                return response
            error_body = await response.aread()
            await response.aclose()
            if not memory.response_is_oom(tenant, response.status_code, error_body):
                return _replay_response(response, error_body)
            # The first try is over: its reservation goes before the retry reserves its bigger need
            # (under the same key it would only have counted once more, with the old size and baseline).
            self.arb.settle(handoff)
            retry, _ = await self.arb.admit(tenant, request, body, f"OOM answer to {trigger}", oom=True)
            outcome = "no plan" if retry is None or not retry.plan.feasible or not retry.plan.starved else "retried"
            if outcome == "retried":
                response = await forward(body)
                if response.status_code < 400:
                    self._record_retry(tenant, retry, "succeeded")
                    return response
                error_body = await response.aread()
                await response.aclose()
            self._record_retry(tenant, retry, "failed" if outcome == "retried" else outcome)
            return _with_blockers(response, error_body, retry)
        finally:
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


def traffic_json(states: Mapping[str, TenantState]) -> dict[str, Any]:
    return {name: {"busy": s.busy, "why": s.busy_reason, "in_flight": s.in_flight} for name, s in states.items()}
