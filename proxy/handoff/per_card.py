"""The handoff's decisions on a host with several GPUs. PURE, like the planner it wraps.

Memory on one card cannot serve a load on another, so every decision is made per card: the
snapshot is cut down to one device (its figures, the process entries on it) and the existing
`plan_release` / `schedule` run on that cut unchanged. A tenant pinned to or discovered on one card
(`AttributedSnapshot.placement`, from proxy/gpu/devices.py) is planned on that card only; one that
may use several (or any) is planned on each, and the best plan wins: ready now, then ready after
releases (fewest bytes released), then waiting, then refused; ties go to the card with most free
memory, which is also where CUDA engines tend to put a new load.

With one device every function here is the planner's own call on the same arguments, so a
single-GPU host behaves exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from proxy.config.registry import Registry
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory
from proxy.handoff.hold import NO_HOLD, SwapHold
from proxy.handoff.plan import Plan, PlanMode, TenantState, plan_release
from proxy.handoff.policy import (
    DEFAULT_OVERTAKE_LIMIT,
    Releasing,
    Verdict,
    Waiter,
    promised_by_tenant,
    queue_order,
    schedule,
)


def candidates(snap: AttributedSnapshot, tenant: str) -> tuple[int, ...]:
    """The cards a tenant's next load may land on (every card when nothing says which)."""
    devices = tuple(d.index for d in snap.snapshot.all_devices)
    placement = snap.placement.get(tenant)
    if placement is None or placement.devices is None:
        return devices
    return tuple(i for i in devices if i in placement.devices) or devices


def shares(snap: AttributedSnapshot, tenant: str, index: int) -> bool:
    """Whether a tenant's loads may take memory on this card (unplaced tenants: on every card)."""
    placement = snap.placement.get(tenant)
    return placement is None or placement.allows(index)


def device(snap: AttributedSnapshot, index: int | None) -> DeviceMemory:
    """The card a plan was made on (the snapshot's device when it names none)."""
    if index is None:
        return snap.snapshot.device
    return next((d for d in snap.snapshot.all_devices if d.index == index), snap.snapshot.device)


def _on(plan: Plan, dev: DeviceMemory) -> Plan:
    where = f"GPU {dev.index}" + (f" ({dev.name})" if dev.name else "")
    return replace(plan, device=dev.index, device_name=dev.name, explanation=f"{where}: {plan.explanation}")


def _rank(plan: Plan) -> tuple[int, int, int]:
    if plan.feasible and not plan.releases:
        order = 0
    elif plan.feasible:
        order = 1
    elif plan.possible:
        order = 2
    else:
        order = 3
    return (order, plan.expected_free_bytes, -(plan.free_bytes - plan.promised_bytes))


def plan_on_devices(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
                    requester: str, need_bytes: int, *, promised: Mapping[str, int] | None = None,
                    mode: PlanMode = "request") -> Plan:
    """`plan_release` on the requester's card(s); `promised`: tenant -> bytes, as plan_release takes it."""
    if not snap.snapshot.several_devices:
        return plan_release(snap, registry, states, requester, need_bytes, promised=promised, mode=mode)
    best: Plan | None = None
    for index in candidates(snap, requester):
        here = {t: n for t, n in (promised or {}).items() if shares(snap, t, index)}
        plan = _on(plan_release(snap.on_device(index), registry, states, requester, need_bytes,
                                promised=here, mode=mode), device(snap, index))
        if best is None or _rank(plan) < _rank(best):
            best = plan
    assert best is not None  # a snapshot always has a device
    return best


def schedule_on_devices(snap: AttributedSnapshot, registry: Registry, states: Mapping[str, TenantState],
                        waiters: Iterable[Waiter], promised: Mapping[str, tuple[str, int]], now: float,
                        starvation_after_s: float, releasing: Sequence[Releasing] = (),
                        overtake_limit: int = DEFAULT_OVERTAKE_LIMIT, hold: SwapHold = NO_HOLD,
                        room: Mapping[str, int] | None = None) -> tuple[Verdict, ...]:
    """`schedule` per card: each waiter goes to its tenant's card (the best one when it may use
    several), each card's queue is scheduled on that card alone, and the verdicts come back in
    queue order. Each card may start its own handoff; the queue still runs one at a time."""
    pending = list(waiters)
    if not snap.snapshot.several_devices:
        return schedule(snap, registry, states, pending, promised, now, starvation_after_s, releasing, overtake_limit,
                        hold, room)
    by_device: dict[int, list[Waiter]] = {}
    for w in pending:
        choices = candidates(snap, w.tenant)
        index = choices[0]
        if len(choices) > 1:
            chosen = plan_on_devices(snap, registry, states, w.tenant, w.need_bytes,
                                     promised=promised_by_tenant(promised, w.key))
            index = chosen.device if chosen.device is not None else index
        by_device.setdefault(index, []).append(w)
    verdicts: dict[int, Verdict] = {}
    for index, group in by_device.items():
        here = {k: (t, n) for k, (t, n) in promised.items() if shares(snap, t, index)}
        dev = device(snap, index)
        for v in schedule(snap.on_device(index), registry, states, group, here, now, starvation_after_s, releasing,
                          overtake_limit, hold, room):
            verdicts[v.waiter.id] = replace(v, plan=_on(v.plan, dev))
    return tuple(verdicts[w.id] for w in queue_order(pending, now, starvation_after_s))


def held_on(snap: AttributedSnapshot, tenant: str, index: int | None) -> int:
    """What a tenant holds on one card (all of them when `index` is None)."""
    if index is None or not snap.snapshot.several_devices:
        return snap.held_by(tenant)
    return snap.on_device(index).held_by(tenant)


def free_for(snap: AttributedSnapshot, tenant: str) -> int:
    """The most free memory on any card the tenant may use."""
    if not snap.snapshot.several_devices:
        return snap.free_bytes
    return max(device(snap, i).free_bytes for i in candidates(snap, tenant))
