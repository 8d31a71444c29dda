"""Tenants that sleep: stopped by the proxy (a lifecycle tenant: `process`, `systemd`, `docker`), or
released by a soft step with a `resume` call (vLLM's /sleep and /wake_up). One owner of their state:
which ones must be woken before their next request, the shared wake under way for each, and every
start and stop as a decision.

The scheduler never awaits a start or a stop (invariant 11): a stop is a step of a release, which
runs as a task of its own; a start is awaited by the requests that need the tenant (they share one),
after the queue has made room for it like for a load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import httpx

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import ReleaseSpec, Tenant
from proxy.engines import ReleaseFailed
from proxy.engines.ports import LifecyclePorts
from proxy.handoff.decisions import DecisionLog, LifecycleExit, LifecycleResult, LifecycleStart, LifecycleStop, Resumed
from proxy.lifecycle import report_json
from proxy.lifecycle.build import lifecycle_for
from proxy.lifecycle.controller import LifecycleError, within
from proxy.lifecycle.cuda_driver import Checkpointer
from proxy.lifecycle.state import LifecycleReport, TenantLifecycle
from proxy.lifecycle.suspender import Procs, RestoreFailed, Suspensions

log = logging.getLogger("hyperswap.lifecycle")

Busy = Callable[[], bool]
WAKE_SLACK_S = 1.0  # a request waits for a start at most its start_timeout_s plus this (a failed start's cleanup)


class Lifecycles:
    def __init__(self, tenants: Iterable[Tenant], adapter: Callable[[Tenant], LifecyclePorts], clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient, *, state_dir: Path | None = None,
                 controllers: Mapping[str, TenantLifecycle] | None = None,
                 checkpointer: Checkpointer | None = None) -> None:
        """`controllers`: tenant -> a ready-made state machine (tests); otherwise built from tenants.json.
        `checkpointer`: the CUDA suspend seam of every `cuda_suspend` tenant (the demo's, tests');
        None: the real one, refused here (ConfigError) when the driver cannot do it."""
        self._adapter = adapter
        self._clock = clock
        self._decisions = decisions
        self._control = control
        self._tenants = {t.name: t for t in tenants}
        # the admin token's variable is never a started app's (HYPERSWAP_* never are: lifecycle/process.py)
        withheld = (tenants.config.admin.token_env,) if isinstance(tenants, Registry) else ()
        self._machines: dict[str, TenantLifecycle] = dict(controllers or {})
        for t in self._tenants.values():
            if t.name in self._machines or t.lifecycle is None:
                continue
            machine = lifecycle_for(t, adapter(t).ready_path, clock=clock, state_dir=state_dir, client=control,
                                    withheld_env=withheld)
            if machine is not None:
                self._machines[t.name] = machine
        for machine in self._machines.values():
            machine.on_report = self._record
            machine.on_state = self._state_changed
        # tenants whose CUDA processes a `cuda_suspend` step parks in host RAM (restored before a request)
        self.suspensions = Suspensions(self._tenants.values(), clock, checkpointer, env=os.environ)
        self.suspensions.on_state.append(self._state_changed)
        self._resume: dict[str, ReleaseSpec] = {}  # tenant -> the released step whose resume call is owed
        self._resuming: dict[str, asyncio.Task[None]] = {}
        self.on_change: list[Callable[[str], None]] = []  # a start or stop ended (the queue is kicked)
        self.on_report: list[Callable[[LifecycleReport], None]] = []  # every start, stop and end (metrics, events)
        self.on_state: list[Callable[[str], None]] = []  # a tenant's state changed, told when it happens (events)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._machines

    def machine(self, tenant: str) -> TenantLifecycle | None:
        return self._machines.get(tenant)

    def machines(self) -> Mapping[str, TenantLifecycle]:
        return dict(self._machines)

    def dormant(self, tenant: str) -> bool:
        """Must be woken (started, or its resume called) before a request is forwarded to it."""
        machine = self._machines.get(tenant)
        return (tenant in self._resume or (machine is not None and machine.state != "running")
                or self.suspensions.dormant(tenant))

    async def adopt(self) -> None:
        """At the proxy's start: a unit or container already up is adopted as running."""
        names = list(self._machines)  # together: a hung controller costs its status timeout once, not once each
        found = await asyncio.gather(*(self._machines[n].adopt() for n in names), return_exceptions=True)
        for name, result in zip(names, found, strict=True):
            if isinstance(result, Exception):  # an unreachable socket is a health entry, not a failed start of the proxy
                log.warning("%s: could not read its state at start: %s", name, result)

    # -- releasing -----------------------------------------------------------------------------------
    async def stop(self, tenant: Tenant, busy: Busy) -> LifecycleReport:
        """Stop the tenant if it is idle; awaited by a release task (never by the scheduler)."""
        machine = self._machines.get(tenant.name)
        if machine is None:
            return LifecycleReport(tenant.name, "stop", False, "running", error="no lifecycle controller", refused=True)
        return await machine.begin_stop(busy)

    async def suspend(self, tenant: Tenant, procs: Procs) -> dict[str, object]:
        """A `cuda_suspend` step: park the tenant's processes in host RAM; raises ReleaseFailed (the
        next step of its release list runs). Awaited by a release task (never by the scheduler)."""
        return await self.suspensions.suspend(tenant, procs)

    def released(self, tenant: Tenant, step: ReleaseSpec) -> None:
        """A soft release step freed the memory: its `resume` call is owed before the next request."""
        if step.resumes:
            self._resume[tenant.name] = step

    # -- waking --------------------------------------------------------------------------------------
    async def wake(self, tenant: Tenant) -> LifecycleReport | None:
        """Start the tenant (sharing a start under way) or call its owed resume; raises LifecycleError
        (a 503 with the reason and the app's last output lines) when it cannot be woken."""
        machine = self._machines.get(tenant.name)
        if machine is not None and machine.state != "running":
            if self.suspensions.dormant(tenant.name):  # it ended while suspended: what was parked is gone
                await self.suspensions.settled(tenant.name)
                self.suspensions.exited(tenant.name)
            self._resume.pop(tenant.name, None)
            return await self._started(tenant, machine)
        if tenant.name in self._resume or self.suspensions.dormant(tenant.name):
            task = self._resuming.get(tenant.name)
            if task is None:
                task = asyncio.create_task(self._run_resume(tenant), name=f"hyperswap:resume:{tenant.name}")
                self._resuming[tenant.name] = task
            await asyncio.shield(task)
        return None

    async def _started(self, tenant: Tenant, machine: TenantLifecycle) -> LifecycleReport:
        """Await the shared start for at most the tenant's start_timeout_s (plus WAKE_SLACK_S): a
        controller call that hangs past its own bound, or the stop of a failed start, never holds a
        request longer. The start goes on; the next request shares it."""
        limit = tenant.start_timeout_s + WAKE_SLACK_S
        finished, report = await within(self._clock, limit, machine.ensure_running())
        if finished and report is not None:
            return report
        known = machine.controller.describe().get("error")
        err = LifecycleError(
            f"tenant {tenant.name!r} was not started within {tenant.start_timeout_s:g} s (start_timeout_s)"
            + (f": {known}" if known else f"; it is {machine.state}"),
            fix=f"see its lifecycle entry in health (GET /api/health) and the controller's own logs; raise "
                f"tenants.{tenant.name}.start_timeout_s if it only needs longer", output=machine.controller.output())
        err.details.update({"tenant": tenant.name, "state": machine.state, "retry_in_s": 1})
        raise err

    async def start(self, tenant: Tenant, *, force: bool = False) -> LifecycleReport:
        """Start the tenant (sharing a start under way) and return how it went, never raising: the
        admin's start (`force`: past the backoff after a failed start). Cancelling the caller does not
        cancel the start."""
        machine = self._machines.get(tenant.name)
        if machine is None:
            return LifecycleReport(tenant.name, "start", False, "running", error="no lifecycle controller", refused=True)
        return await asyncio.shield(machine.begin_start(force=force))

    async def _run_resume(self, tenant: Tenant) -> None:
        step = self._resume.get(tenant.name)
        started = self._clock.now()
        try:
            if step is None or step.suspends:  # parked in host RAM (or being parked: the restore waits for it)
                asked = await self._restore(tenant)
            else:
                asked = await self._adapter(tenant).resume(self._control, step)
        except (ReleaseFailed, httpx.HTTPError) as exc:
            self._decisions.emit(Resumed(tenant=tenant.name, trigger="request to a released tenant", ok=False,
                                         duration_s=self._clock.now() - started, error=str(exc)))
            record = self.suspensions.record(tenant.name)
            fix = (record.fix if isinstance(exc, RestoreFailed) and record is not None and record.fix else
                   f"check that {tenant.name} answers its resume call (tenants.json release.resume), then send the "
                   "request again")
            raise LifecycleError(f"tenant {tenant.name!r} could not be resumed: {exc}", fix=fix) from exc
        finally:
            self._resuming.pop(tenant.name, None)
        self._resume.pop(tenant.name, None)
        fell_back = asked is not None and "fallback" in asked  # a restore that failed, and what was done instead
        self._decisions.emit(Resumed(tenant=tenant.name, trigger="request to a released tenant", ok=not fell_back,
                                     duration_s=self._clock.now() - started, asked=asked,
                                     error=str(asked["error"]) if asked is not None and fell_back else None))
        self._changed(tenant.name)

    async def _restore(self, tenant: Tenant) -> dict[str, object] | None:
        """Restore a suspended tenant. A restore that fails falls back to the next step of its
        release list: a tenant the proxy starts is stopped and started again (its model reloads);
        any other is a 503 with the reason, and its next request is forwarded as is. A process that
        exited while suspended is forwarded to at once: what is left of the app answers (Ollama's
        server loads the model again in a new runner)."""
        try:
            return await self.suspensions.restore(tenant.name)
        except RestoreFailed as exc:
            self._resume.pop(tenant.name, None)
            machine = self._machines.get(tenant.name)
            if machine is None and exc.gone:  # the app (or its parent: Ollama's server) answers for itself
                return {"restored": None, "fallback": "forwarded: the process had exited", "error": str(exc)}
            if machine is None:
                raise
            if machine.state == "running":
                await machine.begin_stop(lambda: False)  # what is left of it holds nothing worth keeping
            report = await self._started(tenant, machine)
            self.suspensions.recovered(tenant.name)
            return {"restored": None, "fallback": "stop and start", "error": f"{exc}; stopped and started it instead",
                    "start": report_json.LifecycleReport.of(report).dump()}

    # -- plumbing ------------------------------------------------------------------------------------
    def _record(self, report: LifecycleReport) -> None:
        """Every start and stop that ran, and every end on its own, as a decision with its duration."""
        result: LifecycleResult = "ok" if report.ok else "refused" if report.refused else "failed"
        if report.action == "exit":
            self._decisions.emit(LifecycleExit(
                tenant=report.tenant, trigger="supervisor", result=result, duration_s=report.duration_s,
                state=report.state, error=report.error, fix=report.fix, output=report.output,
                retry_in_s=report.retry_in_s, exit_code=report.exit_code, restart_in_s=report.restart_in_s))
            log.warning("%s: %s", report.tenant, report.error)
        else:
            event = LifecycleStart if report.action == "start" else LifecycleStop
            self._decisions.emit(event(tenant=report.tenant, trigger=f"lifecycle {report.action}", result=result,
                                       duration_s=report.duration_s, state=report.state, error=report.error,
                                       fix=report.fix, output=report.output, retry_in_s=report.retry_in_s))
        for fn in list(self.on_report):
            try:
                fn(report)
            except Exception:  # a broken subscriber must not break a start
                log.exception("lifecycle subscriber failed")
        self._changed(report.tenant)

    def _state_changed(self, tenant: str) -> None:
        for fn in list(self.on_state):
            try:
                fn(tenant)
            except Exception:
                log.exception("lifecycle state subscriber failed")

    def _changed(self, tenant: str) -> None:
        for fn in list(self.on_change):
            fn(tenant)

    async def aclose(self) -> None:
        """At the proxy's stop: what it started itself (a child process) stops with it; units and
        containers are left running for the next proxy to adopt."""
        for task in list(self._resuming.values()):
            task.cancel()
        for machine in self._machines.values():
            with contextlib.suppress(Exception):
                await machine.aclose()
