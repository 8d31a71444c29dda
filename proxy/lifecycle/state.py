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
next start is allowed after an exponential backoff (capped). A stop that fails leaves the state
`failed` (never `running`: the next request starts it, or finds it running, through its probe).

Supervision (design invariant 12): while it runs, a task awaits the controller's `wait_exit` (a
child's exit, the moment it happens) and, when a liveness probe is given, tries it every
`live_interval_s`: `LIVE_MISSES` misses in a row count as a failure. An app that ended goes to
`exited` (code 0) or `failed` (any other end, or no answer) with the reason and its last output
lines, reported like a start or stop (a decision), and the controller's stop runs at once, before
any new start: it cleans up what a child that ended left (its group, its descendants), and it ends
an app that stopped answering (a hung or SIGSTOPped one: its stop path, SIGKILL after its
stop_timeout_s), so the next request starts a fresh copy instead of waiting `start_timeout_s` on the
hung one's port (issue 42: it waited 120 s and got 503). The next request starts it again; crashes in
a row (an app that ran `STABLE_S` or longer starts the count over) back off like failed starts, the
first not at all. A restart policy `on-failure` starts it at once (after that backoff) and, when that
start fails, again after each failed start's backoff, up to `restart_limit` tries in a row (crashes
and failed starts together); `restart_in_s` of each report and `restart_status` of the view say
what it will do. `never` waits for a request. Every change of state is told to `on_state` when it
happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from proxy.clock import Clock
from proxy.lifecycle.controller import JSON, Controller, Exit, LifecycleError, Status
from proxy.lifecycle.ready import Liveness, Readiness

log = logging.getLogger("hyperswap.lifecycle")

LifecycleState = Literal["running", "stopped", "starting", "stopping", "failed", "exited"]
Action = Literal["start", "stop", "exit"]
RestartPolicy = Literal["never", "on-failure"]

STABLE_S = 60.0  # an app that ran this long before it crashed starts the crash count (and its backoff) over
LIVE_INTERVAL_S = 5.0  # seconds between liveness probes of a running tenant
LIVE_MISSES = 3  # probes in a row that must fail before a running tenant counts as failed


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
    crashes: int = 0  # consecutive ends while running (exits, kills, no answer)
    exit_code: int | None = None  # how the app ended, when it ended on its own and the code is known

    def start_refused(self, now: float) -> str | None:
        """Why a start may not begin now (backing off after a failure), or None."""
        if self.retry_at is not None and now < self.retry_at:
            what = "it ended" if self.state == "exited" or (self.crashes and not self.failures) else "its last start failed"
            return f"{what} ({self.error}); the next try is allowed in {self.retry_at - now:.1f} s"
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
        return Lifecycle("running", now, crashes=self.crashes)  # crashes in a row: counted until it runs STABLE_S

    def start_failed(self, now: float, error: str, fix: str | None, output: tuple[str, ...], backoff: Backoff) -> Lifecycle:
        failures = self.failures + 1
        return Lifecycle("failed", now, failures, now + backoff.after(failures), error, fix, output, self.crashes)

    def ended(self, now: float, reason: str, code: int | None, failed: bool, output: tuple[str, ...],
              backoff: Backoff) -> Lifecycle:
        """It ended on its own while running (or stopped answering): `failed`, or `exited` on code 0.
        The first crash after a stable run may start again at once; crashes in a row back off."""
        ran = now - self.since
        crashes = 1 if ran >= STABLE_S else self.crashes + 1
        retry = backoff.after(crashes - 1)
        error = f"it {reason} after running {ran:.1f} s"
        fix = ("its last output lines say why (the app's log); the next request starts it again"
               + (f" (in {retry:g} s: it ended {crashes} times in a row)" if retry else ""))
        return Lifecycle("failed" if failed else "exited", now, 0, now + retry if retry else None, error, fix,
                         output, crashes, code)

    def stopping(self, now: float) -> Lifecycle:
        return replace(self, state="stopping", since=now)

    def stopped(self, now: float) -> Lifecycle:
        # a failed start's count and backoff stay: stopping does not make the next start likelier to work
        return replace(self, state="stopped", since=now)

    def stop_failed(self, now: float, error: str, fix: str | None, output: tuple[str, ...] = ()) -> Lifecycle:
        """Never `running`: what runs is not known to be well (the next request starts it, or finds it
        running through its probe). No backoff: a stop failing says nothing about the next start."""
        return replace(self, state="failed", since=now, error=f"its stop failed: {error}", fix=fix, output=output)


@dataclass(frozen=True, slots=True)
class LifecycleReport:
    """How one start or stop ended (or why it did not begin): what the scheduler hears back."""

    tenant: str
    action: Action
    ok: bool
    state: LifecycleState  # after it
    duration_s: float = 0.0  # exit: how long it ran
    error: str | None = None
    fix: str | None = None
    output: tuple[str, ...] = ()
    retry_in_s: float | None = None  # a refused or failed start: when the next may begin
    refused: bool = False  # it never began (busy, starting, backing off)
    exit_code: int | None = None  # exit: its code (negative: the signal), when known
    restart_in_s: float | None = None  # exit: the restart policy starts it again in this long; None: it does not

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
                 backoff: Backoff | None = None, on_report: OnDone | None = None, live: Liveness | None = None,
                 live_interval_s: float = LIVE_INTERVAL_S, restart: RestartPolicy = "never",
                 restart_limit: int = 3, preload: bool = False) -> None:
        self.tenant = tenant
        self.controller = controller
        self._ready = ready
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.backoff = backoff or Backoff()
        self.on_report = on_report  # every start, stop and end that ran (the decision log, metrics, events)
        self.on_state: Callable[[str], None] | None = None  # told the tenant's name at every change of state
        self.live = live
        self.live_interval_s = live_interval_s
        self.restart = restart
        self.restart_limit = restart_limit
        self.preload = preload  # started once the proxy is up (tenants.json `preload`)
        self.preload_error: str | None = None  # why that start failed (health shows it until the app runs)
        self.preload_fix: str | None = None
        self._snap = Lifecycle(since=clock.now())
        self._start: asyncio.Task[LifecycleReport] | None = None
        self._stop: asyncio.Task[LifecycleReport] | None = None
        self._watcher: asyncio.Task[None] | None = None  # supervises a running app
        self._restart: asyncio.Task[None] | None = None  # the restart policy's start, waiting for its backoff
        self._by_policy = False  # the start under way was begun by the restart policy
        self.restart_status: str | None = None  # what the restart policy does next, or that it gave up

    @property
    def snapshot(self) -> Lifecycle:
        return self._snap

    @property
    def state(self) -> LifecycleState:
        return self._snap.state

    def _set(self, snap: Lifecycle) -> None:
        """The one place the snapshot changes: a change of state is told at once."""
        changed = snap.state != self._snap.state
        self._snap = snap
        if changed and self.on_state is not None:
            try:
                self.on_state(self.tenant)
            except Exception:  # a broken subscriber must not break a start
                log.exception("lifecycle state subscriber failed")

    async def adopt(self) -> Lifecycle:
        """At the proxy's start: end what an earlier run left behind (where provably its own), then take
        over whatever runs (a unit or container already up) as running, supervised."""
        with contextlib.suppress(Exception):
            for ended in await self.controller.clean_up():
                log.warning("%s: ended %s, left behind by an earlier run of the proxy", self.tenant, ended)
        self._set(self._snap.adopted(await self.controller.status(), self.clock.now()))
        if self._snap.state == "running":
            self._supervise()
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
            self._set(self._snap.starting(self.clock.now()))  # at once: every caller sees "starting"
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
                self._set(self._snap.starting(self.clock.now()))
            began = self.clock.now()
            try:
                await self.controller.start()
                await self._ready(max(0.0, self.start_timeout_s - (self.clock.now() - began)))
            except Exception as exc:
                return await self._start_failed(began, exc)
            self._set(self._snap.started(self.clock.now()))
            self.restart_status = None
            self._supervise()
            return self._report(LifecycleReport(self.tenant, "start", True, "running", self.clock.now() - began))
        finally:
            self._start = None
            self._by_policy = False

    async def _start_failed(self, began: float, exc: Exception) -> LifecycleReport:
        error = exc.message if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
        fix = exc.fix if isinstance(exc, LifecycleError) else None
        output = (exc.output if isinstance(exc, LifecycleError) else ()) or self.controller.output()
        with contextlib.suppress(Exception):  # whatever was launched must not keep memory (best effort)
            await self.controller.stop()
        output = output or self.controller.output()
        self._set(self._snap.start_failed(self.clock.now(), error, fix, output, self.backoff))
        retry = (self._snap.retry_at or 0.0) - self.clock.now()
        restart_in = self._policy_next() if self._by_policy else None
        if self._by_policy:
            self.restart_status = self._policy_gave_up() if restart_in is None else self._policy_says(restart_in)
        if restart_in is not None and self._restart is None:
            self._restart = asyncio.create_task(self._restart_after(restart_in), name=f"lifecycle-restart-{self.tenant}")
        return self._report(LifecycleReport(self.tenant, "start", False, "failed", self.clock.now() - began, error,
                                            fix, output, round(retry, 3), restart_in_s=restart_in))

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
        self._cancel(self._restart)
        self.restart_status = None
        self._set(self._snap.stopping(self.clock.now()))
        self._stop = asyncio.create_task(self._run_stop(), name=f"lifecycle-stop-{self.tenant}")
        return self._watch(self._stop, on_done)

    async def _run_stop(self) -> LifecycleReport:
        began = self.clock.now()
        self._cancel(self._watcher)
        try:
            try:
                await self.controller.stop()
                if await self.controller.status() == "running":
                    raise LifecycleError("it still runs after the stop", fix="see its logs for why it did not stop")
            except Exception as exc:
                error = exc.message if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
                fix = exc.fix if isinstance(exc, LifecycleError) else None
                output = self.controller.output()
                self._set(self._snap.stop_failed(self.clock.now(), error, fix, output))
                return self._report(LifecycleReport(self.tenant, "stop", False, self._snap.state,
                                                    self.clock.now() - began, error, fix, output))
            self._set(self._snap.stopped(self.clock.now()))
            return self._report(LifecycleReport(self.tenant, "stop", True, "stopped", self.clock.now() - began))
        finally:
            self._stop = None

    # -- supervision ---------------------------------------------------------------------------------
    def _supervise(self) -> None:
        self._cancel(self._watcher)
        self._watcher = asyncio.create_task(self._run_watch(), name=f"lifecycle-watch-{self.tenant}")

    def _cancel(self, task: asyncio.Task[None] | None) -> None:
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _quiet(self) -> bool:
        """Running with no start or stop under way: what supervision may judge."""
        return self._snap.state == "running" and self._start is None and self._stop is None

    async def _run_watch(self) -> None:
        """While it runs: its exit, the moment it happens, and (given a liveness probe) its answers."""
        exit_task: asyncio.Future[Exit | None] | None = asyncio.ensure_future(self.controller.wait_exit())
        misses, why = 0, ""
        try:
            while True:
                if not await self._next_watch_event(exit_task):
                    return  # nothing can be watched: a controller that cannot tell, and no probe
                if exit_task is not None and exit_task.done():
                    ended = exit_task.result()
                    exit_task = None
                    if ended is not None and self._quiet():
                        await self._ended(ended.reason, ended.code, ended.failed)
                        return
                    continue
                if not self._quiet() or self.live is None:
                    continue
                problem = await self.live()
                misses, why = (misses + 1, problem) if problem else (0, "")
                if misses >= LIVE_MISSES and self._quiet():
                    await self._ended(f"stopped answering ({misses} probes in a row: {why})", None, True)
                    return
        finally:
            self._watch_over(exit_task)

    async def _next_watch_event(self, exit_task: asyncio.Future[Exit | None] | None) -> bool:
        """Waits for the exit or the next liveness tick, whichever comes first; False at once when
        there is neither to wait for."""
        waits: set[asyncio.Future[Exit | None] | asyncio.Future[None]] = set()
        if exit_task is not None:
            waits.add(exit_task)
        tick = asyncio.ensure_future(self.clock.sleep(self.live_interval_s)) if self.live else None
        if tick is not None:
            waits.add(tick)
        if not waits:
            return False
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if tick is not None:
                tick.cancel()
        return True

    def _watch_over(self, exit_task: asyncio.Future[Exit | None] | None) -> None:
        """The watch ends: its wait on the exit is dropped, and the watcher slot freed if it is this one."""
        if exit_task is not None:
            exit_task.cancel()
        if self._watcher is asyncio.current_task():
            self._watcher = None

    async def _ended(self, reason: str, code: int | None, failed: bool) -> None:
        """It ended on its own (or stopped answering): the state says so, a report is recorded, the
        controller's stop runs before any new start (what a child that ended left; a hung app
        itself, by its stop path then SIGKILL), and the restart policy may start it again."""
        now = self.clock.now()
        ran = now - self._snap.since
        self._set(self._snap.ended(now, reason, code, failed, self.controller.output(), self.backoff))
        self._stop = asyncio.create_task(self._clean_up(), name=f"lifecycle-cleanup-{self.tenant}")
        snap = self._snap
        restart_in = self._policy_next() if failed else None
        self.restart_status = None if restart_in is None else self._policy_says(restart_in)
        if restart_in is not None:
            self._restart = asyncio.create_task(self._restart_after(restart_in), name=f"lifecycle-restart-{self.tenant}")
        elif failed and self.restart == "on-failure":
            self.restart_status = self._policy_gave_up()
        self._report(LifecycleReport(self.tenant, "exit", False, snap.state, ran, snap.error, snap.fix, snap.output,
                                     None if snap.retry_at is None else round(snap.retry_at - now, 3),
                                     exit_code=code, restart_in_s=restart_in))

    async def _clean_up(self) -> LifecycleReport:
        """What an app that ended left (its group, its descendants): stopped before any new start."""
        try:
            await self.controller.stop()
        except Exception as exc:
            log.warning("%s: cleaning up after its end: %s", self.tenant, exc)
        finally:
            self._stop = None
        return LifecycleReport(self.tenant, "stop", True, self._snap.state)

    async def _restart_after(self, delay_s: float) -> None:
        """The restart policy's next try: a start after `delay_s`. When that start fails, `_start_failed`
        schedules the next one after its backoff, while the tries in a row stay within the limit."""
        try:
            if delay_s > 0:
                await self.clock.sleep(delay_s)
            if self._snap.state in ("failed", "exited") and self._start is None:
                self._by_policy = True
                self.begin_start(force=True)  # its own delay was the backoff
        finally:
            if self._restart is asyncio.current_task():
                self._restart = None

    def _policy_next(self) -> float | None:
        """Seconds until the restart policy tries again, after a crash or a failed start of its own;
        None when it does not (policy `never`, or `restart_limit` tries in a row already made)."""
        snap = self._snap
        if self.restart != "on-failure" or not snap.crashes or snap.crashes + snap.failures > self.restart_limit:
            return None
        return max(0.0, (snap.retry_at or self.clock.now()) - self.clock.now())

    def _policy_says(self, delay_s: float) -> str:
        tries = self._snap.crashes + self._snap.failures
        return (f"restart: on-failure starts it again{f' in {delay_s:.1f} s' if delay_s else ''} "
                f"(try {tries} of {self.restart_limit} in a row)")

    def _policy_gave_up(self) -> str:
        return (f"restart: on-failure gave up after {self.restart_limit} tries in a row (restart_limit): "
                f"the next request, or the admin's start, starts it")

    def restart_pending(self) -> bool:
        """The restart policy will start it again by itself (a try is scheduled or under way)."""
        return self._restart is not None or (self._start is not None and self._by_policy)

    def preloaded(self, error: str | None, fix: str | None = None) -> None:
        """How the start at the proxy's start went: None when it runs, else why not (and what to do)."""
        self.preload_error, self.preload_fix = error, fix

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
                "output": list(s.output), "failures": s.failures, "crashes": s.crashes, "exit_code": s.exit_code,
                "restart": self.restart, "restart_status": self.restart_status, "preload": self.preload,
                "preload_error": self.preload_error,
                "retry_in_s": round(s.retry_at - now, 3) if s.retry_at is not None and s.retry_at > now else None,
                "controller": self.controller.describe()}

    async def aclose(self) -> None:
        """At the proxy's shutdown: cancel a start or stop under way, then let the controller stop what
        it started itself (a child process; units and containers are left running)."""
        for task in (self._restart, self._watcher, self._start, self._stop):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.controller.aclose()
