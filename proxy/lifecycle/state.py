"""One lifecycle tenant's state: running, stopped, starting, stopping or failed.

`Lifecycle` is the pure part: a frozen snapshot and its transitions, tested without a loop.
`TenantLifecycle` owns one tenant's snapshot and runs the effects through its `Controller`:

- `begin_start()` / `begin_stop(busy)` return at once with a future of a `LifecycleReport`, so the
  scheduler *starts* an effect and hears back through `on_done` (llama-swap's StartSwap/OnSwapDone),
  never awaiting it. A refusal (backing off after a failed start, busy, starting) is a report too:
  data, not an exception.
- `ensure_running()` is for a request handler: it awaits the one shared start (every concurrent
  caller gets the same outcome; a caller that goes away does not cancel it) and raises the failure
  as a LifecycleError (a 503 with the reason and the app's last output lines).

Stop is refused while `busy()` says the tenant has work in flight, and while it starts. A start
asked for while a stop runs waits for the stop, then starts. A failed start stops whatever was
launched (no half-started app keeps memory), goes to `failed` with the reason and output, and the
next start is allowed after an exponential backoff (capped).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from proxy.clock import Clock
from proxy.lifecycle.controller import JSON, Controller, LifecycleError, Status
from proxy.lifecycle.ready import Readiness

LifecycleState = Literal["running", "stopped", "starting", "stopping", "failed"]
Action = Literal["start", "stop"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Seconds before another start is allowed after `failures` consecutive failed starts."""

    first_s: float = 1.0
    cap_s: float = 60.0

    def after(self, failures: int) -> float:
        return 0.0 if failures <= 0 else min(self.cap_s, self.first_s * 2 ** min(failures - 1, 30))


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """One tenant's lifecycle as data; every transition returns a new snapshot."""

    state: LifecycleState = "stopped"
    since: float = 0.0
    failures: int = 0  # consecutive failed starts
    retry_at: float | None = None  # no start before this (monotonic seconds), after a failure
    error: str | None = None
    fix: str | None = None
    output: tuple[str, ...] = ()

    def start_refused(self, now: float) -> str | None:
        """Why a start may not begin now (backing off after a failure), or None."""
        if self.retry_at is not None and now < self.retry_at:
            return (f"its last start failed ({self.error}); the next try is allowed in "
                    f"{self.retry_at - now:.1f} s")
        return None

    def stop_refused(self, busy: bool) -> str | None:
        """Why a stop may not begin now, or None (stopped and stopping are no refusals: nothing to do,
        or already under way)."""
        if busy:
            return "it is busy (requests, streams, websockets or jobs in flight): a busy tenant is never stopped"
        if self.state == "starting":
            return "it is starting: it is stopped only once it runs and is idle"
        return None

    def adopted(self, status: Status, now: float) -> Lifecycle:
        """What the controller found at the proxy's start (a running unit or container is adopted)."""
        return replace(self, state="running" if status == "running" else "stopped", since=now)

    def starting(self, now: float) -> Lifecycle:
        return replace(self, state="starting", since=now)

    def started(self, now: float) -> Lifecycle:
        return Lifecycle("running", now)

    def start_failed(self, now: float, error: str, fix: str | None, output: tuple[str, ...], backoff: Backoff) -> Lifecycle:
        failures = self.failures + 1
        return Lifecycle("failed", now, failures, now + backoff.after(failures), error, fix, output)

    def stopping(self, now: float) -> Lifecycle:
        return replace(self, state="stopping", since=now)

    def stopped(self, now: float) -> Lifecycle:
        # a failed start's count and backoff stay: stopping does not make the next start likelier to work
        return replace(self, state="stopped", since=now)

    def stop_failed(self, now: float, error: str, fix: str | None) -> Lifecycle:
        return replace(self, state="running", since=now, error=error, fix=fix)


@dataclass(frozen=True, slots=True)
class LifecycleReport:
    """How one start or stop ended (or why it did not begin): what the scheduler hears back."""

    tenant: str
    action: Action
    ok: bool
    state: LifecycleState  # after it
    duration_s: float = 0.0
    error: str | None = None
    fix: str | None = None
    output: tuple[str, ...] = ()
    retry_in_s: float | None = None  # a refused or failed start: when the next may begin
    refused: bool = False  # it never began (busy, starting, backing off)

    def to_json(self) -> JSON:
        return {"tenant": self.tenant, "action": self.action, "ok": self.ok, "state": self.state,
                "duration_s": round(self.duration_s, 3), "error": self.error, "fix": self.fix,
                "output": list(self.output), "retry_in_s": self.retry_in_s, "refused": self.refused}

    def error_for_client(self) -> LifecycleError:
        """The failed start as the 503 a held request gets."""
        err = LifecycleError(f"tenant {self.tenant!r} could not be started: {self.error}", fix=self.fix,
                             output=self.output)
        err.details.update({"tenant": self.tenant, "state": self.state, "retry_in_s": self.retry_in_s})
        return err


OnDone = Callable[[LifecycleReport], None]


class TenantLifecycle:
    """The one owner of a lifecycle tenant's state and of the tasks that start and stop it."""

    def __init__(self, tenant: str, controller: Controller, ready: Readiness, *, start_timeout_s: float, clock: Clock,
                 backoff: Backoff | None = None, on_report: OnDone | None = None) -> None:
        self.tenant = tenant
        self.controller = controller
        self._ready = ready
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.backoff = backoff or Backoff()
        self.on_report = on_report  # every start and stop that ran (the decision log, metrics, events)
        self._snap = Lifecycle(since=clock.now())
        self._start: asyncio.Task[LifecycleReport] | None = None
        self._stop: asyncio.Task[LifecycleReport] | None = None

    @property
    def snapshot(self) -> Lifecycle:
        return self._snap

    @property
    def state(self) -> LifecycleState:
        return self._snap.state

    async def adopt(self) -> Lifecycle:
        """At the proxy's start: take over whatever runs (a unit or container already up) as running."""
        self._snap = self._snap.adopted(await self.controller.status(), self.clock.now())
        return self._snap

    # -- starting ------------------------------------------------------------------------------------
    def begin_start(self, on_done: OnDone | None = None, *, force: bool = False) -> asyncio.Future[LifecycleReport]:
        """Start the tenant unless it runs: returns at once. Concurrent calls share one start task.
        `force` (the admin's start button) skips the backoff after a failure."""
        if self._start is not None:
            return self._watch(self._start, on_done)
        if self._snap.state == "running" and self._stop is None:
            return self._done(LifecycleReport(self.tenant, "start", True, "running"), on_done)
        refused = None if force else self._snap.start_refused(self.clock.now())
        if refused is not None:
            retry = (self._snap.retry_at or 0.0) - self.clock.now()
            return self._done(LifecycleReport(self.tenant, "start", False, self._snap.state, error=refused,
                                              fix=self._snap.fix, output=self._snap.output,
                                              retry_in_s=round(retry, 3), refused=True), on_done)
        if self._stop is None:
            self._snap = self._snap.starting(self.clock.now())  # at once: every caller sees "starting"
        self._start = asyncio.create_task(self._run_start(), name=f"lifecycle-start-{self.tenant}")
        return self._watch(self._start, on_done)

    async def ensure_running(self) -> LifecycleReport:
        """Return once the tenant runs and is ready (sharing any start under way); raise LifecycleError
        when the start fails or is refused. Cancelling the caller does not cancel the start."""
        report = await asyncio.shield(self.begin_start())
        if not report.ok:
            raise report.error_for_client()
        return report

    async def _run_start(self) -> LifecycleReport:
        try:
            if self._stop is not None:
                await asyncio.shield(self._stop)  # a start asked for during a stop follows it
                self._snap = self._snap.starting(self.clock.now())
            began = self.clock.now()
            try:
                await self.controller.start()
                await self._ready(max(0.0, self.start_timeout_s - (self.clock.now() - began)))
            except Exception as exc:
                return await self._start_failed(began, exc)
            self._snap = self._snap.started(self.clock.now())
            return self._report(LifecycleReport(self.tenant, "start", True, "running", self.clock.now() - began))
        finally:
            self._start = None

    async def _start_failed(self, began: float, exc: Exception) -> LifecycleReport:
        error = exc.message if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
        fix = exc.fix if isinstance(exc, LifecycleError) else None
        output = (exc.output if isinstance(exc, LifecycleError) else ()) or self.controller.output()
        with contextlib.suppress(Exception):  # whatever was launched must not keep memory (best effort)
            await self.controller.stop()
        output = output or self.controller.output()
        self._snap = self._snap.start_failed(self.clock.now(), error, fix, output, self.backoff)
        retry = (self._snap.retry_at or 0.0) - self.clock.now()
        return self._report(LifecycleReport(self.tenant, "start", False, "failed", self.clock.now() - began, error,
                                            fix, output, round(retry, 3)))

    # -- stopping ------------------------------------------------------------------------------------
    def begin_stop(self, busy: Callable[[], bool], on_done: OnDone | None = None) -> asyncio.Future[LifecycleReport]:
        """Stop the tenant if it is idle: returns at once. Refused (a report, not an exception) while
        `busy()` or while it starts; a stop under way is shared."""
        if self._stop is not None:
            return self._watch(self._stop, on_done)
        if self._start is not None:
            refused: str | None = "a start is under way: it is stopped only once it runs and is idle"
        else:
            refused = self._snap.stop_refused(busy())
        if refused is not None:
            return self._done(LifecycleReport(self.tenant, "stop", False, self._snap.state, error=refused,
                                              refused=True), on_done)
        if self._snap.state == "stopped":
            return self._done(LifecycleReport(self.tenant, "stop", True, "stopped"), on_done)
        self._snap = self._snap.stopping(self.clock.now())
        self._stop = asyncio.create_task(self._run_stop(), name=f"lifecycle-stop-{self.tenant}")
        return self._watch(self._stop, on_done)

    async def _run_stop(self) -> LifecycleReport:
        began = self.clock.now()
        try:
            try:
                await self.controller.stop()
                if await self.controller.status() == "running":
                    raise LifecycleError("it still runs after the stop", fix="see its logs for why it did not stop")
            except Exception as exc:
                error = exc.message if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
                fix = exc.fix if isinstance(exc, LifecycleError) else None
                self._snap = self._snap.stop_failed(self.clock.now(), error, fix)
                return self._report(LifecycleReport(self.tenant, "stop", False, self._snap.state,
                                                    self.clock.now() - began, error, fix, self.controller.output()))
            self._snap = self._snap.stopped(self.clock.now())
            return self._report(LifecycleReport(self.tenant, "stop", True, "stopped", self.clock.now() - began))
        finally:
            self._stop = None

    # -- plumbing ------------------------------------------------------------------------------------
    def _report(self, report: LifecycleReport) -> LifecycleReport:
        if self.on_report is not None:
            self.on_report(report)
        return report

    @staticmethod
    def _done(report: LifecycleReport, on_done: OnDone | None) -> asyncio.Future[LifecycleReport]:
        future: asyncio.Future[LifecycleReport] = asyncio.get_running_loop().create_future()
        future.set_result(report)
        return TenantLifecycle._watch(future, on_done)

    @staticmethod
    def _watch(future: asyncio.Future[LifecycleReport], on_done: OnDone | None) -> asyncio.Future[LifecycleReport]:
        if on_done is not None:
            future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else on_done(f.result()))
        return future

    def view(self) -> JSON:
        """For /api/tenants, health and the event stream."""
        s, now = self._snap, self.clock.now()
        return {"state": s.state, "for_s": round(now - s.since, 3), "error": s.error, "fix": s.fix,
                "output": list(s.output), "failures": s.failures,
                "retry_in_s": round(s.retry_at - now, 3) if s.retry_at is not None and s.retry_at > now else None,
                "controller": self.controller.describe()}

    async def aclose(self) -> None:
        """At the proxy's shutdown: cancel a start or stop under way, then let the controller stop what
        it started itself (a child process; units and containers are left running)."""
        for task in (self._start, self._stop):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.controller.aclose()
