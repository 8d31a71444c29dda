"""The owner of every tenant's CUDA suspension (release kind `cuda_suspend`): one `Suspension` record
per tenant (`suspend_state.py`), the driver seam each uses (`cuda_driver.py`), and host RAM as the
budget of what may be parked.

A suspend is a step of a release (run by the release task, never by the scheduler): it fails, so
the next step of the tenant's release list runs, when the host RAM it needs is not there or a
process is not a CUDA one (what it had suspended is restored first: nothing stays half parked). A
restore is awaited by the requests to the tenant (they share one, `proxy/handoff/sleepers.py`); a
request that arrives during the suspend waits for it to end, then for the restore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from proxy.clock import Clock
from proxy.config.schema import ReleaseFailed, Tenant
from proxy.config.units import GIB
from proxy.encoding import JSONModel
from proxy.lifecycle.cuda_driver import Checkpointer, CheckpointError, checkpointer_for
from proxy.lifecycle.cuda_suspend import CudaSuspend
from proxy.lifecycle.suspend_state import SuspendState, Suspension

log = logging.getLogger("hyperswap.suspend")

Procs = Sequence[tuple[int, int]]  # (pid, bytes it holds on the card), attribution's


class Parked(JSONModel):
    """One tenant's device memory parked in host RAM by a suspend."""

    tenant: str
    state: SuspendState
    pids: list[int]
    parked_bytes: int
    parked_gb: float
    since: float
    via: str | None


class HostRam(JSONModel):
    """GET /api/gpu's `host_ram`: what is parked in host RAM, in all, and what is still available."""

    available_bytes: int | None
    parked_bytes: int
    parked: list[Parked]


class RestoreFailed(ReleaseFailed):
    """A restore that did not work: `gone` when the process exited while suspended."""

    def __init__(self, message: str, *, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


class Suspensions:
    def __init__(self, tenants: Iterable[Tenant], clock: Clock, checkpointer: Checkpointer | None = None, *,
                 env: Mapping[str, str] | None = None) -> None:
        """`checkpointer`: one for every tenant (the demo's, tests'); None: each tenant's real one
        (`checkpointer_for`), which raises ConfigError here, at the proxy's start, when it cannot work."""
        self._clock = clock
        self._steps: dict[str, CudaSuspend] = {}
        for t in tenants:
            step = next((s for s in t.release_steps if isinstance(s, CudaSuspend)), None)
            if step is not None:
                self._steps[t.name] = step
        self._drivers: dict[str, Checkpointer] = {
            name: checkpointer or checkpointer_for(step.via, step.utility, env or {}) for name, step in self._steps.items()}
        self._records = {name: Suspension(name) for name in self._steps}
        self._settled: dict[str, asyncio.Event] = {}
        self.on_state: list[Callable[[str], None]] = []

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._records

    def record(self, tenant: str) -> Suspension | None:
        return self._records.get(tenant)

    def records(self) -> Mapping[str, Suspension]:
        return dict(self._records)

    def dormant(self, tenant: str) -> bool:
        rec = self._records.get(tenant)
        return rec is not None and rec.dormant

    def parked_bytes(self, tenant: str | None = None) -> int:
        """What is parked in host RAM: for one tenant, or in all."""
        recs = [self._records[tenant]] if tenant in self._records else [] if tenant else self._records.values()
        return sum(r.parked_bytes for r in recs if r.state in ("suspending", "suspended", "resuming"))

    def host_available_bytes(self) -> int | None:
        """Host RAM available now as the first tenant's driver sees it (all read the same host); None: unknown."""
        return next(iter(self._drivers.values())).host_available_bytes() if self._drivers else None

    def view(self) -> HostRam:
        """What is parked in host RAM (GET /api/gpu's `host_ram`): per tenant, in all, and what is
        still available; null where unknown."""
        parked = [Parked(tenant=r.tenant, state=r.state, pids=list(r.pids), parked_bytes=r.parked_bytes,
                         parked_gb=round(r.parked_bytes / GIB, 2), since=r.since, via=r.via)
                  for r in self._records.values() if r.parked_bytes and r.dormant]
        return HostRam(available_bytes=self.host_available_bytes(), parked_bytes=self.parked_bytes(), parked=parked)

    def _set(self, rec: Suspension) -> None:
        self._records[rec.tenant] = rec
        for fn in list(self.on_state):
            try:
                fn(rec.tenant)
            except Exception:  # a broken subscriber must not break a suspend
                log.exception("suspension state subscriber failed")

    # -- suspending ---------------------------------------------------------------------------------
    async def suspend(self, tenant: Tenant, procs: Procs) -> dict[str, object]:
        """Suspend the tenant's CUDA processes; returns what was done. Raises ReleaseFailed (the next
        release step runs) when host RAM is short, a process is not CUDA, or the driver refuses."""
        step, rec = self._steps[tenant.name], self._records[tenant.name]
        if rec.dormant:
            raise ReleaseFailed(f"{tenant.name} is {rec.state} already")
        driver = self._drivers[tenant.name]
        pids = tuple(pid for pid, _ in procs if pid > 0)
        nbytes = sum(n for pid, n in procs if pid > 0)
        if not pids:
            raise ReleaseFailed(f"{tenant.name} has no process on the card to suspend")
        available = driver.host_available_bytes()
        if available is None:
            raise ReleaseFailed(f"host RAM available is unknown: {tenant.name} is not suspended")
        if nbytes + step.host_ram_margin_bytes > available:
            raise ReleaseFailed(f"host RAM short: suspending {tenant.name} parks {_gib(nbytes)} and leaves "
                                f"{_gib(step.host_ram_margin_bytes)} (host_ram_margin_gb), but {_gib(available)} is available")
        self._settled[tenant.name] = asyncio.Event()
        self._set(rec.suspending(pids, nbytes, driver.via, self._clock.now()))
        done: list[int] = []
        try:
            for pid in pids:
                await driver.suspend(pid, step.lock_timeout_s)
                done.append(pid)
        except CheckpointError as exc:
            await self._roll_back(tenant.name, driver, done, exc)
            raise ReleaseFailed(self._records[tenant.name].error or str(exc)) from None
        finally:
            self._settled.pop(tenant.name).set()
        self._set(self._records[tenant.name].parked(self._clock.now()))
        log.info("%s: suspended %s into host RAM (%s)", tenant.name, _gib(nbytes), driver.via)
        return {"suspended": list(pids), "parked_bytes": nbytes, "via": driver.via, "host_available_bytes": available}

    async def _roll_back(self, tenant: str, driver: Checkpointer, done: list[int], exc: CheckpointError) -> None:
        for pid in reversed(done):
            try:
                await driver.restore(pid)
            except CheckpointError as again:
                log.warning("%s: process %s could not be restored after a failed suspend: %s", tenant, pid, again)
        if exc.not_cuda:
            error = f"{tenant}: {exc} (no CUDA state to suspend); the next release step runs"
            fix = "check the tenant's match rules: attribution gave it a process that does not use CUDA"
        else:
            error = f"{tenant}: the suspend failed: {exc}; the next release step runs"
            fix = exc.fix or "see the driver's message; raise release.lock_timeout_s if its work only needs longer"
        self._set(self._records[tenant].rolled_back(error, fix, self._clock.now()))

    # -- restoring ----------------------------------------------------------------------------------
    async def settled(self, tenant: str) -> None:
        """Wait for a suspend under way to end (a request that arrived during it)."""
        event = self._settled.get(tenant)
        if event is not None:
            await event.wait()

    async def restore(self, tenant: str) -> dict[str, object] | None:
        """Restore the tenant's processes (after a suspend under way ends); None when nothing is
        parked. Raises RestoreFailed (the state is `failed`; nothing is parked any more)."""
        await self.settled(tenant)
        rec = self._records.get(tenant)
        if rec is None or rec.state != "suspended":
            return None
        driver = self._drivers[tenant]
        rec = rec.resuming(self._clock.now())
        self._set(rec)
        for pid in rec.pids:
            try:
                await driver.restore(pid)
            except CheckpointError as exc:
                if exc.gone:
                    error = f"{tenant}: process {pid} exited while suspended; its parked memory went with it"
                    fix = "the next request starts it again when the proxy starts it (a stop step); else start it yourself"
                else:
                    error = f"{tenant}: the restore failed: {exc}"
                    fix = exc.fix or "the app is stopped and started again when its release list has a stop step"
                self._set(rec.failed(error, fix, self._clock.now()))
                raise RestoreFailed(error, gone=exc.gone) from None
        done = rec.back(self._clock.now())
        self._set(done)
        log.info("%s: restored %s in %.2f s (%s)", tenant, _gib(rec.parked_bytes), done.last_restore_s or 0.0, driver.via)
        return {"restored": list(rec.pids), "bytes": rec.parked_bytes, "via": driver.via,
                "duration_s": round(done.last_restore_s or 0.0, 3)}

    def recovered(self, tenant: str) -> None:
        """After a failed restore, the app was started anew: it runs."""
        rec = self._records.get(tenant)
        if rec is not None and rec.state == "failed":
            self._set(rec.recovered(self._clock.now()))

    def exited(self, tenant: str) -> None:
        """The app ended while suspended (its supervisor saw it): nothing is parked any more."""
        rec = self._records.get(tenant)
        if rec is not None and rec.state == "suspended":
            self._set(rec.failed(f"{tenant} exited while suspended; its parked memory went with it",
                                 "its next request starts it again", self._clock.now()))
