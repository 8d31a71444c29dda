"""What one node tells a cluster's inference router: how much waits and runs, what a new load would
cost in memory, and which models are on the card, in the shape the Gateway API Inference Extension's
endpoint picker scrapes from `/metrics` (proxy/admin/metrics.py; docs/guides/several-machines.md). The
formulas are pure functions; `gather` reads their inputs off the scheduler and the latest card reading.

The memory cost of a new load for tenant T, from 0 to 1 (`memory_cost`). L is what the load must still
bring onto the card (its need less what T holds), taken as the scheduler's own planner would take it
(`plan_on_devices`: protection, priorities and several cards count as for a real request):

    free   = min(L, free - promised)                          first: nothing to give up
    idle   = min(L - free, what releasing idle tenants frees)  then: idle tenants released
    busy   = L - free - idle                                  last: a busy tenant must finish
    cost   = (0.25 * free + 0.5 * idle + 1.0 * busy) / L      (1 when no plan can ever fit it)

so 0.25 is a load into free memory, 0.5 one that releases idle tenants, 1 one that waits for a busy
tenant to give the card up. For a tenant with one kind of load (`needs_vram_gb`: ComfyUI, a generic
app), what it holds counts toward its need, so 0 means it holds its need: its model is on the card.
An engine that sizes each model on its own (Ollama: `sized_catalog`; or a tenant with no need set) may
be asked for a model it does not hold: its load is taken as large as all the memory T could reach
(`Plan.reachable_bytes`), and what T holds is added at 0.5 (its other models, which the engine unloads
to make room) or 1 while T is busy, over that whole: a node whose card its own other models fill costs
more than an empty one. Which models are on the card is the models gauge's (the affinity signal). An
unknown card size has no cost (None, never 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from proxy.config.registry import Registry
from proxy.engines.generic import GenericAdapter
from proxy.engines.registry import ADAPTERS
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.per_card import plan_on_devices
from proxy.handoff.plan import Plan, TenantState
from proxy.handoff.policy import promised_by_tenant
from proxy.handoff.scheduler import Scheduler

FREE_WEIGHT = 0.25  # a load into free memory: only the read from disk
IDLE_WEIGHT = 0.5  # idle tenants released first: an unload, seconds
BUSY_WEIGHT = 1.0  # a busy tenant must finish its work first: a render's minutes


@dataclass(frozen=True, slots=True)
class TenantSignals:
    """One tenant's signals for a cluster's picker."""
    tenant: str
    waiting: int  # in the handoff queue, plus jobs queued in the engine behind the one it runs
    running: int  # admitted requests in flight, plus the job the engine runs
    memory_cost: float | None  # 0-1 (module docstring); None: the card's size is unknown
    resident: tuple[str, ...]  # model names on the card
    loading: tuple[str, ...]  # model names admitted and on their way to the card

    @property
    def models(self) -> int:
        return len(self.resident) + len(self.loading)


def memory_cost(plan: Plan, own_weight: float | None = None) -> float | None:
    """The 0-1 cost of the load `plan` was made for (module docstring). `own_weight`: what the tenant's
    own memory costs (an engine that sizes each model: its other models make room); None: it counts
    toward the need at no cost."""
    if plan.unplanned:
        return None
    bring = plan.need_bytes - plan.held_by_requester
    if not plan.possible:
        return BUSY_WEIGHT
    own = own_weight * plan.held_by_requester if own_weight is not None else 0.0
    if bring <= 0:
        return round(own / plan.need_bytes, 4) if own and plan.need_bytes > 0 else 0.0
    free = min(bring, max(0, plan.free_bytes - plan.promised_bytes))
    idle = min(bring - free, plan.expected_free_bytes)
    busy = bring - free - idle
    whole = plan.need_bytes if own_weight is not None else bring
    return round(min(1.0, (FREE_WEIGHT * free + IDLE_WEIGHT * idle + BUSY_WEIGHT * busy + own) / whole), 4)


def sizes_each_model(registry: Registry, tenant: str) -> bool:
    """Whether the tenant's engine sizes each model itself (its needs_vram_gb is only a fallback), or it has none."""
    t = registry.get(tenant)
    return t.needs_vram_bytes <= 0 or ADAPTERS.get(t.engine, GenericAdapter).sized_catalog


def cost_plan(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState], tenant: str,
              promised: Mapping[str, int]) -> Plan:
    """The plan the cost is read from: T's own need, or all the memory it could reach (`sizes_each_model`)."""
    need = registry.get(tenant).needs_vram_bytes
    if sizes_each_model(registry, tenant):
        capacity = snap.snapshot.device.total_bytes - snap.snapshot.device.reserved_bytes
        probe = plan_on_devices(snap, registry, states, tenant, capacity, promised=promised)
        need = probe.reachable_bytes
    return plan_on_devices(snap, registry, states, tenant, need, promised=promised)


def model_names(tenant: str, keys: Iterable[str]) -> tuple[str, ...]:
    """The model names in a tenant's load keys (`tenant:model`; a key that names no model, a generic
    tenant's one load, has none). A tag `:latest` is what the bare name means (Ollama's convention, and
    the name a client sends), so both are listed: the picker compares the request's name as sent."""
    out: list[str] = []
    prefix = tenant + ":"
    for key in keys:
        if not key.startswith(prefix):
            continue
        model = key[len(prefix):].partition("?")[0]  # a variant (content, load options) is no other name
        out.append(model)
        if model.endswith(":latest"):
            out.append(model[: -len(":latest")])
    return tuple(sorted(set(out)))


def work_counts(waiting_here: int, in_flight: int, jobs: int) -> tuple[int, int]:
    """(waiting, running): an engine's job queue runs one job at a time, the rest wait in it."""
    running_jobs = 1 if jobs else 0
    return waiting_here + max(0, jobs - running_jobs), in_flight + running_jobs


def gather(scheduler: Scheduler, registry: Registry, snap: AttributedSnapshot | None) -> list[TenantSignals]:
    """Every tenant's signals now, from the scheduler (waiters, admitted work, loads) and `snap` (the
    latest card reading; None: no cost, the card was never read)."""
    waiting: dict[str, int] = {}
    for w in scheduler.waiting():
        waiting[w["tenant"]] = waiting.get(w["tenant"], 0) + 1
    traffic = scheduler.traffic.snapshot()
    states = scheduler.states(snap) if snap is not None else {}
    claims = scheduler.promised(snap) if snap is not None else {}
    out = []
    for tenant in registry:
        name = tenant.name
        t = traffic.get(name)
        queued, running = work_counts(waiting.get(name, 0), t.in_flight if t else 0, len(t.jobs) if t else 0)
        cost = None
        if snap is not None and snap.snapshot.device.size_known:
            plan = cost_plan(snap, registry, states, name, promised_by_tenant(claims, name))
            busy = states.get(name)
            own = (BUSY_WEIGHT if busy is not None and busy.busy else IDLE_WEIGHT) \
                if sizes_each_model(registry, name) else None
            cost = memory_cost(plan, own)
        resident, loading = scheduler.loads_of(name)
        out.append(TenantSignals(name, queued, running, cost, model_names(name, resident), model_names(name, loading)))
    return out
