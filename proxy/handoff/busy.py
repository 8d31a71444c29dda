"""Who is busy. PURE: a function of the traffic the proxy saw, the engines' own queue reads, what
each tenant holds on the card, and the time. It reads nothing and writes nothing, so the dry run
of `GET /api/plan` and a health check change no state.

Busy never comes from GPU utilisation, shared by every tenant (design.md, invariant 3). A tenant is
busy while:
- a GPU request of it is in flight through the proxy;
- a job the proxy relayed (a ComfyUI prompt id) has not ended, and either the tenant's VRAM is above
  its idle floor or the job is younger than `JOB_LOAD_GRACE_S` (its load may still be on its way);
- its own queue lists running jobs, read after its traffic last changed, and its VRAM is above its
  idle floor (clients that bypass the proxy);
- it would be released by stopping it (its first release step stops the app) and any request,
  stream or websocket is open on its listener: a stop would cut them (invariant 7), so a plan waits
  for them instead of ordering a stop that is refused, planned again and refused again.
Jobs listed while the tenant holds only its idle floor are stale: reported, not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from proxy.handoff.arbiter import TenantState
from proxy.handoff.inflight import TenantTraffic
from proxy.tenants import MIB, Tenant

CONFIRM_SLACK_BYTES = 64 * MIB  # within this of its idle floor a tenant holds "only its floor"
# A job the proxy relayed counts as busy at once, before its load reaches the card; after this long
# with the tenant's VRAM still at its idle floor it is believed stale (invariant 3).
JOB_LOAD_GRACE_S = 30.0


@dataclass(frozen=True, slots=True)
class QueueRead:
    """What a tenant's own queue said was running, and when the read began (monotonic seconds)."""
    started_at: float
    job_ids: tuple[str, ...]


def queue_rows(read: QueueRead | None, traffic: TenantTraffic | None, finished: Callable[[str], bool]) -> tuple[str, ...]:
    """Rows of the engine's queue still worth believing: read after the proxy last saw the tenant's
    traffic change (an older read may predate the end marker), minus jobs the proxy saw end."""
    if read is None:
        return ()
    if traffic is not None and traffic.last_activity is not None and read.started_at < traffic.last_activity:
        return ()
    return tuple(j for j in read.job_ids if not finished(j))


def tenant_state(tenant: Tenant, traffic: TenantTraffic | None, rows: tuple[str, ...], held: int,
                 now: float) -> TenantState:
    """One tenant's busy state. `rows`: its own queue's running jobs (from `queue_rows`)."""
    in_flight = traffic.in_flight if traffic else 0
    own = traffic.jobs if traffic else ()
    rows = tuple(j for j in rows if j not in own)
    above_floor = held > tenant.idle_vram_bytes + CONFIRM_SLACK_BYTES
    fresh = bool(own) and traffic is not None and traffic.newest_job_at is not None \
        and now - traffic.newest_job_at < JOB_LOAD_GRACE_S
    if in_flight:
        return TenantState(tenant.name, True, f"{in_flight} GPU request(s) in flight", in_flight)
    connections = traffic.connections if traffic else 0
    if connections and released_by_stopping(tenant):
        return TenantState(tenant.name, True, f"{connections} request(s), stream(s) or websocket(s) open: "
                                              "a stop would cut them", in_flight)
    if own and (above_floor or fresh):
        why = f"{len(own)} running job(s)" + ("" if above_floor else ", load on its way")
        return TenantState(tenant.name, True, why, in_flight)
    if rows and above_floor:
        return TenantState(tenant.name, True, f"{len(rows)} job(s) in its own queue and VRAM above its idle floor",
                           in_flight)
    if own or rows:
        stale = tuple(dict.fromkeys((*own, *rows)))
        return TenantState(tenant.name, False, f"{len(stale)} job(s) listed but VRAM at its idle floor: stale",
                           in_flight, stale_jobs=stale)
    return TenantState(tenant.name, False, "idle", in_flight)


def released_by_stopping(tenant: Tenant) -> bool:
    """Its release begins by stopping the app (a `process`, `systemd` or `docker` tenant), not with a
    call that leaves it serving."""
    steps = [s for s in tenant.release_steps if s.kind != "none"]
    return bool(steps) and steps[0].stops


def busy_states(tenants: Iterable[Tenant], traffic: Mapping[str, TenantTraffic], reads: Mapping[str, QueueRead],
                finished: Callable[[str, str], bool], held: Callable[[str], int], now: float) -> dict[str, TenantState]:
    """Every tenant's state. `finished(tenant, job)`: the proxy saw that job end; `held(tenant)`:
    what the tenant holds on the card (bytes)."""
    out: dict[str, TenantState] = {}
    for tenant in tenants:
        t = traffic.get(tenant.name)
        rows = queue_rows(reads.get(tenant.name), t, functools.partial(finished, tenant.name))
        out[tenant.name] = tenant_state(tenant, t, rows, held(tenant.name), now)
    return out


def stale_jobs(states: Mapping[str, TenantState]) -> dict[str, list[str]]:
    """Tenant -> job ids listed as running while its VRAM says they are not."""
    return {name: list(s.stale_jobs) for name, s in states.items() if s.stale_jobs}
