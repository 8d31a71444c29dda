"""The timer loop: idle release deadlines, Ollama's CPU spill, stale queue entries.

Every tick records why each tenant was left alone (several reasons can apply, and without them no
one can tell which fired); `GET /api/tenants/{name}` shows them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from .tasks import cancel_and_wait
from .admission import Arbitration, gib
from .engines import memory
from .tenants import GIB

log = logging.getLogger("hyperswap.watchdog")


@dataclass(slots=True)
class TickReport:
    at: float
    reasons: dict[str, str] = field(default_factory=dict)  # tenant -> why nothing (or what) happened
    actions: list[str] = field(default_factory=list)


class Watchdog:
    def __init__(self, arb: Arbitration) -> None:
        self.arb = arb
        self.last: TickReport | None = None
        self._task: asyncio.Task[None] | None = None
        self._spill_seen: set[str] = set()

    def idle_deadline(self, tenant_name: str) -> float | None:
        """Monotonic time at which the tenant is released if it stays idle; None = never."""
        tenant = self.arb.registry.get(tenant_name)
        if tenant.idle_release_after_s is None or not tenant.reclaimable:
            return None
        traffic = self.arb.inflight.snapshot().get(tenant_name)
        last = traffic.last_activity if traffic and traffic.last_activity is not None else self.arb.started_at
        return last + tenant.idle_release_after_s

    async def tick(self) -> TickReport:
        arb = self.arb
        report = TickReport(at=arb.clock.now())
        if arb.handoff_lock.locked():
            report.reasons["*"] = "a handoff is in progress"
            self.last = report
            return report
        await self._read_queues(report)
        snap = await arb.snapshot()
        states = arb.states(snap)
        for tenant in arb.registry:
            name = tenant.name
            state = states[name]
            held = arb.held(snap, name)
            if name in arb.stale_jobs:
                report.actions.append(f"{name}: stale queue entries {arb.stale_jobs[name]}")
            # Starvation first: Ollama spilling layers to the CPU wants memory now.
            if tenant.engine == "ollama" and tenant.upstream:
                try:
                    spilled = await memory.ollama_spill(tenant, arb.control)
                except (httpx.HTTPError, ValueError, memory.ReleaseFailed) as exc:
                    spilled = []
                    report.reasons[name] = f"cannot read /api/ps: {exc}"
                if spilled:
                    await self._relieve_spill(tenant.name, spilled, report)
                    continue
                self._spill_seen.discard(name)
            deadline = self.idle_deadline(name)
            if deadline is None:
                report.reasons.setdefault(name, "no idle release (idle_release_after_s is null or not reclaimable)")
            elif state.busy:
                report.reasons[name] = f"busy: {state.busy_reason}"
            elif held <= tenant.idle_vram_bytes + 64 * 2**20:
                report.reasons[name] = f"holds only its idle floor ({gib(held)} GiB)"
            elif report.at < deadline:
                report.reasons[name] = f"idle release in {deadline - report.at:.0f} s"
            else:
                async with arb.handoff_lock:
                    decision = arb.decisions.record("idle_release", name, "watchdog idle", None,
                                                    idle_s=tenant.idle_release_after_s, held_bytes=held)
                    result = await arb.execute_release(tenant, held - tenant.idle_vram_bytes, snap)
                    arb.decisions.update(decision, releases=[result.to_json()], ok=result.confirmed)
                report.actions.append(f"{name}: idle release freed {gib(result.freed_bytes)} GiB")
                report.reasons[name] = "released after idle timeout"
        self.last = report
        return report

    async def _read_queues(self, report: TickReport) -> None:
        """Jobs the engine's own queue says are running (clients that bypass the proxy, or stale rows)."""
        for tenant in self.arb.registry:
            if tenant.engine != "comfyui" or not tenant.upstream:
                continue
            try:
                self.arb.queued_elsewhere[tenant.name] = tuple(await memory.comfy_running_prompts(tenant, self.arb.control))
            except (httpx.HTTPError, ValueError, memory.ReleaseFailed) as exc:
                self.arb.queued_elsewhere.pop(tenant.name, None)
                report.reasons[tenant.name] = f"cannot read /queue: {exc}"

    async def _relieve_spill(self, name: str, spilled: list[dict[str, object]], report: TickReport) -> None:
        need = sum(int(m.get("size", 0)) for m in spilled)  # type: ignore[call-overload]
        models = ", ".join(str(m.get("name")) for m in spilled)
        async with self.arb.handoff_lock:
            handoff = await self.arb.reclaim(name, need, f"watchdog: {models} spilling to the CPU", kind="spill")
        if not handoff.plan.starved:
            report.reasons[name] = f"{models} on the CPU in part but the card has room: waiting for Ollama to reload"
        elif handoff.plan.feasible:
            report.actions.append(f"{name}: spill of {models}: released {[r.tenant for r in handoff.releases]}")
            report.reasons[name] = "starved (CPU spill): memory reclaimed; the model reloads on its next request"
        else:
            report.reasons[name] = f"starved (CPU spill) and no plan: {handoff.plan.explanation}"
        self._spill_seen.add(name)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="hyperswap:watchdog")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        interval = self.arb.registry.config.proxy.watchdog_interval_s
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watchdog tick failed")
            await asyncio.sleep(interval)


__all__ = ["Watchdog", "TickReport", "GIB"]
