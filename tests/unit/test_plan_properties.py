"""The planner's contract as properties over random registries, cards and busy states (hypothesis).

Each example: up to five generic tenants with random priorities, floors, release strategies and
protection, holding random amounts, some busy, some unmanaged memory, a random requester and need.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.registry import Registry
from proxy.config.units import GIB
from proxy.engines.loading import registry_from_dict
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.plan import TenantState, plan_release
from tests.unit.cards import busy, idle, snap

MIB = 2**20
NAMES = ("a", "b", "c", "d", "e")


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Registry, AttributedSnapshot, dict[str, TenantState], str, int]:
    n = draw(st.integers(min_value=1, max_value=len(NAMES)))
    names = NAMES[:n]
    tenants: dict[str, Any] = {"ollama": None, "comfyui": None, "desktop": None}
    for name in names:
        tenants[name] = {
            "engine": "generic",
            "match": {"cmdline_patterns": [f"^{name} "]},
            "priority": draw(st.integers(min_value=0, max_value=3)),
            "idle_vram_gb": draw(st.sampled_from([0.0, 0.25, 0.5])),
            "protect_idle_memory": draw(st.booleans()),
            "release": draw(st.sampled_from([{"kind": "http", "url": "/release"}, {"kind": "none", "reason": "cannot"}])),
        }
    reg = registry_from_dict({"tenants": tenants})
    procs: list[tuple[str, int, int | None]] = []
    for i, name in enumerate(names):
        for j in range(draw(st.integers(min_value=0, max_value=2))):
            procs.append((name, 100 * i + j + 1, draw(st.integers(min_value=0, max_value=8 * 1024)) * MIB))
    if draw(st.booleans()):
        procs.append(("unmanaged", 999, draw(st.integers(min_value=1, max_value=2048)) * MIB))
    held = sum(u or 0 for _, _, u in procs)
    total = 24 * GIB
    free = draw(st.integers(min_value=0, max_value=max(0, total - 300 * MIB - held) // MIB)) * MIB
    card = snap(procs, free=free, total=total)
    states = idle(*names)
    for name in names:
        if draw(st.booleans()):
            states = busy(states, name)
    requester = draw(st.sampled_from(names))
    need = draw(st.integers(min_value=0, max_value=30 * 1024)) * MIB
    return reg, card, states, requester, need


def expected(reg: Registry, card: AttributedSnapshot, name: str) -> int:
    return max(0, card.held_by(name) - reg.get(name).idle_vram_bytes)


def short_by(card: AttributedSnapshot, requester: str, need: int) -> int:
    return need - card.free_bytes - card.held_by(requester)


PROPERTY = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(worlds())
def test_only_idle_reclaimable_unprotected_tenants_other_than_the_requester_are_released(world: Any) -> None:
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need)
    rprio = reg.get(requester).priority
    for r in plan.releases:
        t = reg.get(r.tenant)
        assert r.tenant != requester and t.reclaimable and not states[r.tenant].busy
        assert not (t.protect_idle_memory and t.priority > rprio), "protected idle memory was taken"
        assert r.expected_free_bytes > 0, "a release expected to free nothing"


@PROPERTY
@given(worlds())
def test_a_feasible_plan_covers_the_need_and_every_release_is_needed(world: Any) -> None:
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need)
    if not plan.feasible:
        return
    gap = short_by(card, requester, need)
    assert plan.expected_free_bytes >= gap
    for r in plan.releases:
        assert plan.expected_free_bytes - r.expected_free_bytes < gap, f"{r.tenant} was not needed"


@PROPERTY
@given(worlds())
def test_impossible_means_not_even_every_reclaimable_tenant_busy_or_idle_would_do(world: Any) -> None:
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need)
    rprio = reg.get(requester).priority
    reachable = card.free_bytes + card.held_by(requester) + sum(
        expected(reg, card, t.name) for t in reg if t.name != requester and t.name in states and t.reclaimable
        and not (t.protect_idle_memory and t.priority > rprio))
    capacity = card.snapshot.device.total_bytes - card.snapshot.device.reserved_bytes
    assert plan.possible == (reachable >= need and need <= capacity)
    if plan.possible and not plan.feasible:
        assert plan.wait_for and all(states[t].busy for t in plan.wait_for), "waits for nobody busy"


@PROPERTY
@given(worlds())
def test_relief_only_ever_takes_from_tenants_below_the_starved_one(world: Any) -> None:
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need, mode="relief")
    assert all(reg.get(r.tenant).priority < reg.get(requester).priority for r in plan.releases)


@PROPERTY
@given(worlds())
def test_every_process_holding_memory_in_a_refused_plan_is_released_in_it_or_named(world: Any) -> None:
    # (a need larger than the card blames nobody: no release could ever help)
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need)
    device = card.snapshot.device
    if plan.possible or need > device.total_bytes - device.reserved_bytes:
        return
    named = {b.pid for b in plan.blockers}
    released = {r.tenant for r in plan.releases}
    for ap in card.processes:
        if ap.tenant not in released and (ap.process.used_bytes or 0) > 0:
            assert ap.process.pid in named, f"pid {ap.process.pid} ({ap.tenant}) holds memory but is not named"


@PROPERTY
@given(worlds())
def test_every_process_holding_memory_in_a_waiting_plan_is_released_in_it_or_named(world: Any) -> None:
    # issue 27.6: idle reclaimable holders of a plan that waits were in neither list
    reg, card, states, requester, need = world
    plan = plan_release(card, reg, states, requester, need)
    if plan.outcome != "wait":
        return
    named = {b.pid for b in plan.blockers}
    released = {r.tenant for r in plan.releases}
    for ap in card.processes:
        if ap.tenant not in released and (ap.process.used_bytes or 0) > 0:
            assert ap.process.pid in named, f"pid {ap.process.pid} ({ap.tenant}) holds memory but is not named"
