"""Who is busy. PURE: a function of the traffic the proxy saw, the engines' own queue reads, what
each tenant holds on the card, and the time. It reads nothing and writes nothing, so the dry run
of `GET /api/plan` and a health check change no state.

Busy never comes from GPU utilisation, shared by every tenant (design.md, invariant 3), only from
evidence the proxy has. A tenant is busy while:
- a GPU request of it is in flight through the proxy;
- a job the proxy relayed (a ComfyUI prompt id) has not ended, and
  - where its VRAM is observable (a GPU reader, an engine on the card): the VRAM is above its idle
    floor, or the job is younger than `JOB_LOAD_GRACE_S` (its load may still be on its way);
  - where it is not (an engine on the CPU, no GPU reader): a read of its own queue made after its
    traffic last changed lists the job, or the job is younger than the grace, or no such read exists
    yet; an engine whose queue cannot be read keeps its jobs busy for `job_lost_after_s`;
- its own queue lists running jobs, read after its traffic last changed (clients that bypass the
  proxy), corroborated by VRAM above the floor where VRAM is observable.
A job is stale only on positive evidence that it is not running: listed while the tenant holds only
its idle floor on a card that shows it ("vram"), missing from a fresh read of its queue ("unlisted"),
or its engine silent past `job_lost_after_s` ("unreachable"). Stale jobs are reported, not counted.
- it would be released by stopping it (its first release step stops the app) and any request,
  stream or websocket is open on its listener: a stop would cut them (invariant 7), so a plan waits
  for them instead of ordering a stop that is refused, planned again and refused again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from proxy.config.schema import Tenant
from proxy.config.settings import ProxySettings
from proxy.config.units import MIB
from proxy.handoff.inflight import TenantTraffic
from proxy.handoff.plan import TenantState

CONFIRM_SLACK_BYTES = 64 * MIB  # within this of its idle floor a tenant holds "only its floor"
# A job the proxy relayed counts as busy at once, before its load reaches the card; after this long
# with the tenant's VRAM still at its idle floor it is believed stale (invariant 3).
JOB_LOAD_GRACE_S = 30.0
DEFAULT_JOB_LOST_AFTER_S = ProxySettings().job_lost_after_s  # tenants.json's default, for callers that pass none


@dataclass(frozen=True, slots=True)
class QueueRead:
    """What a tenant's own queue said was running, and when the read began (monotonic seconds)."""
    started_at: float
    job_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the proxy knows of one tenant besides its traffic."""
    held: int  # bytes on the card (0 when nothing of it is seen)
    observable: bool = True  # its VRAM can be read: a GPU reader, and an engine on the card (not the CPU)
    rows: tuple[str, ...] | None = None  # its queue's running jobs, read after its traffic last changed; None: no such read
    unreachable_for: float | None = None  # its queue has not answered for this long (None: it answers)


def queue_rows(read: QueueRead | None, traffic: TenantTraffic | None,
               finished: Callable[[str], bool]) -> tuple[str, ...] | None:
    """Rows of the engine's queue still worth believing: read after the proxy last saw the tenant's
    traffic change (an older read may predate the end marker), minus jobs the proxy saw end. None:
    no read to believe."""
    if read is None:
        return None
    if traffic is not None and traffic.last_activity is not None and read.started_at < traffic.last_activity:
        return None
    return tuple(j for j in read.job_ids if not finished(j))


def tenant_state(tenant: Tenant, traffic: TenantTraffic | None, ev: Evidence, now: float,
                 job_lost_after_s: float = DEFAULT_JOB_LOST_AFTER_S) -> TenantState:
    """One tenant's busy state from its traffic and the evidence."""
    in_flight = traffic.in_flight if traffic else 0
    own = traffic.jobs if traffic else ()
    rows = ev.rows or ()
    others = tuple(j for j in rows if j not in own)
    above_floor = ev.held > tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES
    verdict = _Verdict(tenant.name, in_flight)
    if in_flight:
        return verdict.busy(f"{in_flight} GPU request(s) in flight")
    connections = traffic.connections if traffic else 0
    if connections and released_by_stopping(tenant):
        return verdict.busy(f"{connections} request(s), stream(s) or websocket(s) open: a stop would cut them")
    if own:
        fresh = traffic is not None and traffic.newest_job_at is not None and now - traffic.newest_job_at < JOB_LOAD_GRACE_S
        return _own_jobs(verdict, own, others, ev, above_floor=above_floor, fresh=fresh, lost_after_s=job_lost_after_s)
    if others:
        if not ev.observable:
            return verdict.busy(f"{len(others)} job(s) in its own queue")
        if above_floor:
            return verdict.busy(f"{len(others)} job(s) in its own queue and VRAM above its idle floor")
        return verdict.stale(others, "vram", "VRAM at its idle floor")
    return TenantState(tenant.name, False, "idle", in_flight)


@dataclass(frozen=True, slots=True)
class _Verdict:
    """How `tenant_state` says busy or stale for one tenant."""

    tenant: str
    in_flight: int

    def busy(self, why: str) -> TenantState:
        return TenantState(self.tenant, True, why, self.in_flight)

    def stale(self, jobs: tuple[str, ...], why: str, text: str) -> TenantState:
        jobs = tuple(dict.fromkeys(jobs))
        return TenantState(self.tenant, False, f"{len(jobs)} job(s) listed but {text}: stale", self.in_flight,
                           stale_jobs=jobs, stale_why=why)


def _own_jobs(verdict: _Verdict, own: tuple[str, ...], others: tuple[str, ...], ev: Evidence, *, above_floor: bool,
              fresh: bool, lost_after_s: float) -> TenantState:
    """A tenant with jobs the proxy saw start: busy while the evidence says they run, else stale."""
    jobs = _jobs_text(own, ev.rows)
    if ev.unreachable_for is not None:
        if ev.unreachable_for < lost_after_s:
            return verdict.busy(f"{jobs}; its queue has not answered for {ev.unreachable_for:.0f} s")
        return verdict.stale(own, "unreachable", f"its queue has not answered for {ev.unreachable_for:.0f} s")
    if ev.observable:
        if above_floor or fresh:
            return verdict.busy(jobs + ("" if above_floor else ", load on its way"))
        return verdict.stale((*own, *others), "vram", "VRAM at its idle floor")
    if fresh or ev.rows is None or any(j in ev.rows for j in own):
        return verdict.busy(jobs + (", listed by its own queue" if ev.rows else ""))
    return verdict.stale(own, "unlisted", "its own queue no longer lists them")


def _jobs_text(own: tuple[str, ...], rows: tuple[str, ...] | None) -> str:
    """The proxy's own jobs, running and pending counted apart where the engine's queue read (its
    running jobs, read after the traffic last changed) tells them; text only, never the decision."""
    if rows is None:  # no read to tell them apart: one job is taken as running, more may wait
        return "1 running job(s)" if len(own) == 1 else f"{len(own)} job(s) running or pending"
    running = sum(1 for j in own if j in rows)
    pending = len(own) - running
    if running and pending:
        return f"{running} running, {pending} pending job(s)"
    return f"{running} running job(s)" if running else f"{pending} pending job(s)"


def released_by_stopping(tenant: Tenant) -> bool:
    """Its release begins by stopping the app (a `process`, `systemd` or `docker` tenant), not with a
    call that leaves it serving."""
    steps = [s for s in tenant.release_steps if s.reclaims]
    return bool(steps) and steps[0].stops


def busy_states(tenants: Iterable[Tenant], traffic: Mapping[str, TenantTraffic], reads: Mapping[str, QueueRead],
                finished: Callable[[str, str], bool], held: Callable[[str], int], now: float, *,
                observable: Callable[[str], bool] = lambda name: True,
                unreachable_since: Mapping[str, float] | None = None,
                job_lost_after_s: float = DEFAULT_JOB_LOST_AFTER_S) -> dict[str, TenantState]:
    """Every tenant's state. `finished(tenant, job)`: the proxy saw that job end; `held(tenant)`:
    what the tenant holds on the card (bytes); `observable(tenant)`: its VRAM can be read;
    `unreachable_since`: tenant -> when its queue last failed to answer, since the last good read."""
    out: dict[str, TenantState] = {}
    down = unreachable_since or {}
    for tenant in tenants:
        t = traffic.get(tenant.name)
        rows = queue_rows(reads.get(tenant.name), t, functools.partial(finished, tenant.name))
        since = down.get(tenant.name)
        ev = Evidence(held(tenant.name), observable(tenant.name), rows, None if since is None else max(0.0, now - since))
        out[tenant.name] = tenant_state(tenant, t, ev, now, job_lost_after_s)
    return out


class StatesOnDemand(Mapping[str, TenantState]):
    """Every tenant's state, worked out (by `compute`, once) only when a reader asks for one: a plan
    with room for its need on the reading never looks at who is busy (`plan.decide`), so a request
    admitted at once on a resident load skips the whole pass. `compute` must read only what cannot
    change before the first look (the caller looks in the same synchronous step)."""

    __slots__ = ("_compute", "_states")

    def __init__(self, compute: Callable[[], dict[str, TenantState]]) -> None:
        self._compute = compute
        self._states: dict[str, TenantState] | None = None

    def _all(self) -> dict[str, TenantState]:
        if self._states is None:
            self._states = self._compute()
        return self._states

    def __getitem__(self, name: str) -> TenantState:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    @property
    def computed(self) -> bool:
        """Some reader asked: the states were worked out."""
        return self._states is not None


def stale_jobs(states: Mapping[str, TenantState]) -> dict[str, list[str]]:
    """Tenant -> job ids listed as running while the evidence says they are not."""
    return {name: list(s.stale_jobs) for name, s in states.items() if s.stale_jobs}


def at_once_room(tenants: Iterable[Tenant], traffic: Mapping[str, TenantTraffic],
                 runs_at_once: Callable[[str], int | None]) -> dict[str, int]:
    """Tenant -> how many more requests its engine runs at once (`runs_at_once`: None, no bound) beyond
    the work admitted to it now (requests in flight and jobs); tenants with no such bound are absent."""
    room: dict[str, int] = {}
    for tenant in tenants:
        cap = runs_at_once(tenant.name)
        if cap is not None:
            t = traffic.get(tenant.name)
            room[tenant.name] = cap - (t.in_flight + len(t.jobs) if t is not None else 0)
    return room
