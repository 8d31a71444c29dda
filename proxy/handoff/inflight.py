"""Traffic the proxy saw, per tenant: GPU requests in flight and engine jobs still queued.

This is the busy signal (design invariant 3): never GPU utilisation, always what passed through.
One owner object; listeners (the watchdog, the dashboard) subscribe with `on_change`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from proxy.clock import Clock, SystemClock
from proxy.tasks import cancel_and_wait, sleep_or_wake

log = logging.getLogger("hyperswap.inflight")

# Bytes of a counted request passing mark activity at most this often per tenant: the mark is one
# clock read and a compare per relayed chunk, and last_activity_age_s is shown to a tenth of a second
# but only read against idle timers of minutes.
ACTIVITY_RESOLUTION_S = 1.0

# Job ids finished before anyone tracked them (a cached ComfyUI prompt can end, over the socket,
# before the proxy has parsed the POST /prompt answer). Bounded: old ids fall out.
_EARLY_FINISH_MEMORY = 1024


@dataclass(frozen=True, slots=True)
class TenantTraffic:
    in_flight: int
    jobs: tuple[str, ...]
    last_activity: float | None
    newest_job_at: float | None = None  # when the most recent of `jobs` was tracked
    connections: int = 0  # open client requests and websockets of any kind, GPU or not

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or bool(self.jobs)


@dataclass(frozen=True, slots=True)
class Token:
    """One GPU request on its way through the proxy. It counts as its tenant's work only once the
    scheduler admitted it (`InFlight.admit`): a request still waiting for memory is not work, or two
    waiters could each wait for the other's tenant to finish (design invariant 3)."""
    tenant: str
    serial: int


ChangeListener = Callable[[str, TenantTraffic], None]
# A request left flight: its tenant and the status its client got (None: no answer was started,
# the client went away first).
DepartureListener = Callable[[str, int | None], None]


class InFlight:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self._serial = itertools.count(1)
        self._open: dict[int, str] = {}  # token serial -> tenant, admitted requests (work)
        self._waiting: dict[int, str] = {}  # token serial -> tenant, requests not admitted yet (not work)
        self._counts: dict[str, int] = {}
        self._jobs: dict[str, dict[str, float]] = {}  # tenant -> job id -> tracked since
        self._early: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._finished: OrderedDict[tuple[str, str], None] = OrderedDict()  # ends seen, bounded
        self._last: dict[str, float] = {}
        self._idle_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._connections: dict[str, int] = {}  # tenant -> open client requests and websockets of any kind
        self.on_change: list[ChangeListener] = []
        self.on_departure: list[DepartureListener] = []

    # -- requests -------------------------------------------------------------------------
    def begin(self, tenant: str, *, admitted: bool = True) -> Token:
        """A GPU request arrived. `admitted=False`: it goes to the scheduler first and counts as work
        only from `admit` (the scheduler's own step of admitting it)."""
        token = Token(tenant, next(self._serial))
        if admitted:
            self._count(token)
        else:
            self._waiting[token.serial] = tenant
        return token

    def admit(self, token: Token) -> None:
        """The scheduler admitted the request: from now on it is its tenant's work. Idempotent."""
        if self._waiting.pop(token.serial, None) is not None:
            self._count(token)

    def admitted(self, token: Token) -> bool:
        return token.serial in self._open

    def _count(self, token: Token) -> None:
        self._open[token.serial] = token.tenant
        self._counts[token.tenant] = self._counts.get(token.tenant, 0) + 1
        self._touch(token.tenant)

    def end(self, token: Token, status: int | None = None) -> None:
        """Idempotent: a second end of the same token is ignored. `status`: what the client got."""
        if self._waiting.pop(token.serial, None) is not None:
            self._departed(token.tenant, status)  # never admitted: never work, so busy and activity stay
            return
        tenant = self._open.pop(token.serial, None)
        if tenant is None:
            return
        self._counts[tenant] -= 1
        self._departed(tenant, status)
        self._touch(tenant)

    def _departed(self, tenant: str, status: int | None) -> None:
        for listener in list(self.on_departure):
            try:
                listener(tenant, status)
            except Exception:  # a broken subscriber must not break traffic
                log.exception("departure listener failed")

    def active(self, tenant: str) -> None:
        """Bytes of a counted request passed (a relayed chunk): activity is now, so it counts from a
        request's last byte, not its start. At most once per ACTIVITY_RESOLUTION_S, and listeners
        are not told: nothing they act on (counts, jobs, busy) changed."""
        now = self.clock.now()
        if now - self._last.get(tenant, -ACTIVITY_RESOLUTION_S) >= ACTIVITY_RESOLUTION_S:
            self._last[tenant] = now

    @contextlib.contextmanager
    def request(self, tenant: str) -> Iterator[Token]:
        token = self.begin(tenant)
        try:
            yield token
        finally:
            self.end(token)

    # -- connections ------------------------------------------------------------------------
    @contextlib.contextmanager
    def connection(self, tenant: str) -> Iterator[None]:
        """Any request or websocket open on the tenant's listener, GPU or not. Not busy for a
        release (a UI poll loads nothing), but a tenant the proxy would stop must have none: a stop
        would cut a stream or a websocket in the middle."""
        self.connection_opened(tenant)
        try:
            yield
        finally:
            self.connection_closed(tenant)

    def connection_opened(self, tenant: str) -> None:
        """`connection` without its context manager (the relay's hot path); `connection_closed` must follow."""
        self._connections[tenant] = self._connections.get(tenant, 0) + 1

    def connection_closed(self, tenant: str) -> None:
        self._connections[tenant] -= 1
        if not self._connections[tenant]:  # the queue hears it: a tenant kept from a stop may be stopped now
            self._notify(tenant)  # no activity: a poll that loads nothing moves no idle deadline

    def connections(self, tenant: str) -> int:
        return self._connections.get(tenant, 0)

    # -- jobs -----------------------------------------------------------------------------
    def track_job(self, tenant: str, job_id: str) -> bool:
        """Start counting a queued job. False if its end was already seen."""
        if self._early.pop((tenant, job_id), "missing") is None:
            return False
        jobs = self._jobs.setdefault(tenant, {})
        if job_id not in jobs:
            jobs[job_id] = self.clock.now()
            self._touch(tenant)
        return True

    def finish_job(self, tenant: str, job_id: str) -> bool:
        """Stop counting a job. True if it was tracked; an unknown id is remembered as finished."""
        jobs = self._jobs.get(tenant, {})
        self._finished[(tenant, job_id)] = None
        while len(self._finished) > _EARLY_FINISH_MEMORY:
            self._finished.popitem(last=False)
        if jobs.pop(job_id, None) is None:
            self._early[(tenant, job_id)] = None
            while len(self._early) > _EARLY_FINISH_MEMORY:
                self._early.popitem(last=False)
            return False
        self._touch(tenant)
        return True

    def finished(self, tenant: str, job_id: str) -> bool:
        """Whether the proxy saw this job end (its end marker or history entry)."""
        return (tenant, job_id) in self._finished

    def jobs(self, tenant: str) -> tuple[str, ...]:
        return tuple(self._jobs.get(tenant, {}))

    # -- reading ----------------------------------------------------------------------------
    def traffic(self, tenant: str) -> TenantTraffic:
        jobs = self._jobs.get(tenant, {})
        return TenantTraffic(self._counts.get(tenant, 0), tuple(jobs), self._last.get(tenant),
                             max(jobs.values()) if jobs else None, self._connections.get(tenant, 0))

    def snapshot(self) -> Mapping[str, TenantTraffic]:
        names = set(self._counts) | set(self._jobs) | set(self._last) | {t for t, n in self._connections.items() if n}
        return {name: self.traffic(name) for name in sorted(names)}

    def busy(self, tenant: str) -> bool:
        return self.traffic(tenant).busy

    async def wait_idle(self, tenant: str, timeout_s: float | None = None) -> bool:
        """Wait until the tenant has nothing in flight and no jobs. False on timeout."""
        if not self.busy(tenant):
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.setdefault(tenant, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return False
        finally:
            waiters = self._idle_waiters.get(tenant, [])
            if fut in waiters:
                waiters.remove(fut)
        return True

    # -- internals --------------------------------------------------------------------------
    def _touch(self, tenant: str) -> None:
        self._last[tenant] = self.clock.now()
        self._notify(tenant)

    def _notify(self, tenant: str) -> None:
        traffic = self.traffic(tenant)
        for listener in list(self.on_change):
            try:
                listener(tenant, traffic)
            except Exception:  # a broken subscriber must not break traffic
                log.exception("in-flight listener failed")
        if not traffic.busy and self._idle_waiters.get(tenant):
            for fut in self._idle_waiters.pop(tenant):
                if not fut.done():
                    fut.set_result(None)


JobFate = Literal["running", "done", "lost"]
# Checks a batch of job ids against the engine: each one running, done (its end is in the engine's
# history), or lost (in neither its queue nor its history: deleted from the queue, or the engine
# restarted). Ids it could not tell about are left out.
JobCheck = Callable[[tuple[str, ...]], Awaitable[Mapping[str, JobFate]]]
JobLost = Callable[[str], None]


class JobPoller:
    """Reconciles the tenant's jobs with the engine: ends the jobs no websocket reported (clients
    that never open one) and the jobs the engine no longer has at all.

    Runs while the tenant has jobs and stops by itself; it starts again whenever anyone tracks a job
    for the tenant (the listener after a POST /prompt, admission after re-queueing an OOM'd prompt).
    `check_soon()` runs the next round at once (a relayed queue delete or clear).
    """

    def __init__(self, inflight: InFlight, tenant: str, check: JobCheck, *, interval_s: float = 1.0,
                 clock: Clock | None = None, on_lost: JobLost | None = None, min_gap_s: float = 0.1) -> None:
        self.inflight = inflight
        self.tenant = tenant
        self.check = check
        self.interval_s = interval_s
        self.min_gap_s = min_gap_s  # `check_soon` from clients polling at 50 Hz asks the engine no faster than this
        self.clock = clock or inflight.clock
        self.on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self._soon = asyncio.Event()
        self._stopped = False
        inflight.on_change.append(self._on_change)

    def _on_change(self, tenant: str, traffic: TenantTraffic) -> None:
        if tenant == self.tenant and traffic.jobs:
            self.ensure_running()

    def ensure_running(self) -> None:
        if self._stopped or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # tracked outside the loop (a unit test): nothing to poll with
            return
        self._task = loop.create_task(self._run(), name=f"jobpoll:{self.tenant}")

    def check_soon(self) -> None:
        self._soon.set()

    async def _run(self) -> None:
        last = float("-inf")
        while self.inflight.jobs(self.tenant):
            await sleep_or_wake(self.clock, self.interval_s, self._soon)
            self._soon.clear()
            if (gap := last + self.min_gap_s - self.clock.now()) > 0:
                await self.clock.sleep(gap)
            last = self.clock.now()
            jobs = self.inflight.jobs(self.tenant)
            try:
                fates = await self.check(jobs)
            except Exception as exc:  # the engine being down must not kill the poller
                log.debug("job poll for %s failed: %s", self.tenant, exc)
                continue
            for job_id, fate in fates.items():
                if fate == "running" or not self.inflight.finish_job(self.tenant, job_id):
                    continue
                if fate == "lost" and self.on_lost is not None:
                    self.on_lost(job_id)

    async def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(ValueError):
            self.inflight.on_change.remove(self._on_change)
        await cancel_and_wait(self._task)
