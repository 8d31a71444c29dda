"""The release planner: pure data in, a Plan out. No sockets, no clock."""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping

from proxy.arbiter import Plan, TenantState, plan_release, starved
from proxy.attribution import AttributedProcess, AttributedSnapshot, Attributor
from proxy.gpu import DeviceMemory, GpuProcess, GpuSnapshot
from proxy.tenants import GIB, Registry, registry_from_dict

MIB = 2**20
TOTAL = 24 * GIB
RESERVED = 300 * MIB

STT = {
    "engine": "generic",
    "match": {"process_names": [], "cmdline_patterns": ["stt_relay.py"]},
    "priority": 45,
    "release": {"kind": "http", "url": "/release"},
    "idle_vram_gb": 0.0,
}


def registry(extra: Mapping[str, Any] | None = None) -> Registry:
    # deep copy: registry_from_dict writes "name" into the dicts it is given
    return registry_from_dict({"tenants": copy.deepcopy(dict(extra or {}))})


def snap(procs: list[tuple[str, int, int | None]], *, free: int | None = None, total: int = TOTAL,
         source: str = "simulated") -> AttributedSnapshot:
    """procs: (tenant, pid, used bytes). Free defaults to total - reserved - what is held."""
    held = sum(u or 0 for _, _, u in procs)
    free = total - RESERVED - held if free is None else free
    device = DeviceMemory(0, "test card", total, RESERVED, total - free - RESERVED, free)
    gps = tuple(GpuProcess(pid, f"{tenant}-proc", f"{tenant} --serve", used, float(pid)) for tenant, pid, used in procs)
    s = GpuSnapshot(device, gps, source=source)  # type: ignore[arg-type]
    return AttributedSnapshot(s, tuple(AttributedProcess(p, t) for p, (t, _, _) in zip(gps, procs)))


def idle(*names: str) -> dict[str, TenantState]:
    return {n: TenantState(n, busy=False) for n in names}


def busy(states: dict[str, TenantState], name: str, why: str = "1 request in flight") -> dict[str, TenantState]:
    return {**states, name: TenantState(name, busy=True, busy_reason=why, in_flight=1)}


def released(plan: Plan) -> list[str]:
    return [r.tenant for r in plan.releases]


def reasons(plan: Plan) -> dict[int | None, str]:
    return {b.pid: b.reason for b in plan.blockers}


def test_not_starved_when_free_plus_held_reaches_need() -> None:
    # ollama already holds 5 GiB and 4 GiB are free: an 8 GiB need is not starvation (invariant 4)
    s = snap([("ollama", 1, 5 * GIB), ("comfyui", 2, 10 * GIB)], free=4 * GIB)
    plan = plan_release(s, registry(), idle("ollama", "comfyui"), "ollama", 8 * GIB)
    assert not plan.starved and plan.feasible
    assert plan.releases == () and plan.blockers == ()
    assert "no release needed" in plan.explanation
    assert plan.held_by_requester == 5 * GIB
    assert not starved(s, registry(), "ollama", 8 * GIB)
    assert starved(s, registry(), "ollama", 10 * GIB)


def test_idle_lower_priority_tenant_is_released_down_to_its_floor() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=3 * GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 8 * GIB)
    assert plan.starved and plan.feasible
    assert released(plan) == ["comfyui"]
    # comfyui keeps its CUDA context floor (idle_vram_gb 0.5 in the shipped defaults)
    assert plan.releases[0].expected_free_bytes == 7 * GIB - GIB // 2
    assert plan.releases[0].pids == (2,)
    assert plan.explanation == ("ollama needs 8.00 GiB, 3.00 GiB free: release comfyui "
                                "(idle, priority 40 < 50) to free 6.50 GiB")


def test_busy_tenant_is_never_released() -> None:
    s = snap([("comfyui", 2, 10 * GIB)], free=2 * GIB)
    plan = plan_release(s, registry(), busy(idle(), "comfyui", "prompt abc running"), "ollama", 8 * GIB)
    assert plan.releases == ()
    assert not plan.feasible
    assert reasons(plan) == {2: "busy"}
    assert "prompt abc running" in plan.blockers[0].detail
    assert "busy" in plan.explanation and "comfyui" in plan.explanation


def test_not_reclaimable_tenant_is_a_blocker_with_its_reason() -> None:
    s = snap([("desktop", 3, 2 * GIB), ("comfyui", 2, 4 * GIB)], free=1 * GIB)
    plan = plan_release(s, registry(), idle("comfyui", "desktop"), "ollama", 8 * GIB)
    assert not plan.feasible
    assert released(plan) == ["comfyui"]
    assert reasons(plan) == {3: "not_reclaimable"}
    assert "display server" in plan.blockers[0].detail  # the configured reason reaches the person


def test_equal_or_higher_priority_tenant_is_not_released() -> None:
    reg = registry({"other": {**STT, "priority": 50}})
    s = snap([("other", 5, 6 * GIB)], free=1 * GIB)
    plan = plan_release(s, reg, idle("other"), "ollama", 4 * GIB)
    assert plan.releases == ()
    assert reasons(plan) == {5: "not_lower_priority"}


def test_unmanaged_process_is_named_as_blocker() -> None:
    s = snap([("unmanaged", 777, 3 * GIB)], free=2 * GIB)
    plan = plan_release(s, registry(), {}, "ollama", 4 * GIB)
    assert not plan.feasible
    assert reasons(plan) == {777: "unmanaged"}
    assert "pid 777" in plan.explanation


def test_release_stops_as_soon_as_enough_is_freed() -> None:
    reg = registry({"stt": STT, "tiny": {**STT, "priority": 10, "match": {"cmdline_patterns": ["tiny"]}}})
    s = snap([("tiny", 1, 5 * GIB), ("comfyui", 2, 9 * GIB), ("stt", 3, 2 * GIB)], free=1 * GIB)
    plan = plan_release(s, reg, idle("tiny", "comfyui", "stt"), "ollama", 5 * GIB)
    assert released(plan) == ["tiny"]  # lowest priority first, and 5 GiB was already enough
    assert plan.feasible
    assert plan.blockers == ()  # untouched candidates are not in the way


def test_priority_ties_release_the_larger_holding_first_then_by_name() -> None:
    reg = registry({"a": {**STT, "priority": 40, "match": {"cmdline_patterns": ["aaa"]}},
                    "b": {**STT, "priority": 40, "match": {"cmdline_patterns": ["bbb"]}}})
    s = snap([("a", 1, 2 * GIB), ("b", 2, 2 * GIB), ("comfyui", 3, 6 * GIB + GIB // 2)], free=0)
    plan = plan_release(s, reg, idle("a", "b", "comfyui"), "ollama", 7 * GIB)
    assert released(plan) == ["comfyui", "a"]  # comfyui frees 6 GiB (larger), then a before b by name


def test_infeasible_plan_names_every_process_in_the_way() -> None:
    s = snap([("comfyui", 2, 4 * GIB), ("desktop", 3, GIB), ("desktop", 4, GIB // 2),
              ("unmanaged", 5, 3 * GIB), ("ollama", 6, GIB)], free=2 * GIB)
    plan = plan_release(s, registry(), busy(idle(), "comfyui"), "ollama", 20 * GIB)
    assert not plan.feasible and plan.starved
    assert reasons(plan) == {2: "busy", 3: "not_reclaimable", 4: "not_reclaimable", 5: "unmanaged", 6: "requester"}
    assert "short by" in plan.explanation


def test_feasible_plan_still_lists_skipped_blockers() -> None:
    s = snap([("comfyui", 2, 8 * GIB), ("desktop", 3, GIB)], free=GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 6 * GIB)
    assert plan.feasible and released(plan) == ["comfyui"]
    assert reasons(plan) == {3: "not_reclaimable"}


def test_need_larger_than_the_card_is_infeasible_and_blames_nobody() -> None:
    s = snap([("comfyui", 2, 8 * GIB), ("desktop", 3, GIB)])
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 30 * GIB)
    assert not plan.feasible
    assert plan.releases == ()  # releasing comfyui could never help
    assert "too large for this card" in plan.explanation
    assert "in the way" not in plan.explanation
    assert 3 in reasons(plan)  # blockers are still listed


def test_unknown_memory_is_not_counted_on() -> None:
    s = snap([("comfyui", 2, None), ("unmanaged", 9, None)], free=GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 4 * GIB)
    assert not plan.feasible
    assert released(plan) == ["comfyui"]
    assert plan.releases[0].expected_free_bytes == 0
    assert reasons(plan) == {2: "unknown_memory", 9: "unmanaged"}
    assert "unknown" in plan.explanation


def test_tenant_holding_only_its_floor_is_not_worth_releasing() -> None:
    s = snap([("comfyui", 2, GIB // 2)], free=GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 4 * GIB)
    assert plan.releases == ()
    assert reasons(plan) == {2: "not_reclaimable"}
    assert "idle floor" in plan.blockers[0].detail


def test_three_tenants_release_lowest_first_then_the_next_only_if_still_short() -> None:
    reg = registry({"stt": STT})
    procs: list[tuple[str, int, int | None]] = [("comfyui", 2, 4 * GIB + GIB // 2), ("stt", 3, 3 * GIB)]
    states = idle("comfyui", "stt")
    # short by 3 GiB: comfyui (40) alone frees 4 GiB
    plan = plan_release(snap(procs, free=2 * GIB), reg, states, "ollama", 5 * GIB)
    assert released(plan) == ["comfyui"] and plan.feasible
    # short by 6 GiB: comfyui first, then stt (45)
    plan = plan_release(snap(procs, free=2 * GIB), reg, states, "ollama", 8 * GIB)
    assert released(plan) == ["comfyui", "stt"] and plan.feasible
    assert plan.expected_free_bytes == 7 * GIB


def test_three_tenants_middle_priority_requester_may_only_take_from_below() -> None:
    reg = registry({"stt": STT})
    s = snap([("comfyui", 2, 4 * GIB + GIB // 2), ("ollama", 1, 6 * GIB)], free=GIB)
    plan = plan_release(s, reg, idle("comfyui", "ollama"), "stt", 7 * GIB)
    assert released(plan) == ["comfyui"]
    assert not plan.feasible  # ollama (50) outranks stt (45) and is never a candidate for it
    assert reasons(plan) == {1: "not_lower_priority"}


def test_priority_order_is_a_chain_no_pairwise_rule_can_express() -> None:
    # Two hard-coded rules ("ollama evicts comfyui", "comfyui yields to ollama") cannot say that a
    # third tenant sits between them, that the requester decides who is a candidate, or that a busy
    # lower tenant is skipped for the next one up. One priority chain with busy states does.
    reg = registry({"stt": STT, "batch": {**STT, "priority": 30, "match": {"cmdline_patterns": ["batch"]}}})
    s = snap([("batch", 7, 3 * GIB), ("comfyui", 2, 4 * GIB + GIB // 2), ("stt", 3, 3 * GIB)], free=0)
    states = busy(idle("comfyui", "stt"), "batch")
    plan = plan_release(s, reg, states, "ollama", 6 * GIB)
    assert released(plan) == ["comfyui", "stt"]  # batch (30) is busy, so skip to 40 then 45
    assert reasons(plan) == {7: "busy"}
    # comfyui asking: only batch is below it, and it is busy
    plan = plan_release(s, reg, states, "comfyui", 6 * GIB)
    assert released(plan) == [] and not plan.feasible
    assert reasons(plan) == {7: "busy", 3: "not_lower_priority", 2: "requester"}


def test_plan_is_json_serialisable_with_gib_for_people_and_bytes() -> None:
    s = snap([("comfyui", 2, 7 * GIB), ("desktop", 3, GIB)], free=3 * GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 8 * GIB)
    body = json.loads(json.dumps(plan.to_json()))
    assert body["need_bytes"] == 8 * GIB and body["need_gib"] == 8.0
    assert body["releases"][0]["expected_free_gib"] == 6.5
    assert body["blockers"][0]["reason"] == "not_reclaimable"
    assert body["feasible"] is True and body["estimated"] is False


def test_estimated_snapshot_marks_the_plan_as_estimate() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=GIB, source="engine-estimate")
    assert plan_release(s, registry(), idle("comfyui"), "ollama", 4 * GIB).estimated


def test_plan_is_identical_for_identical_inputs() -> None:
    reg = registry({"stt": STT})
    s = snap([("stt", 3, 3 * GIB), ("comfyui", 2, 3 * GIB + GIB // 2), ("unmanaged", 8, GIB)], free=0)
    plans = {plan_release(s, reg, idle("stt", "comfyui"), "ollama", 5 * GIB) for _ in range(3)}
    assert len(plans) == 1


def test_attributed_simulated_gpu_plans_end_to_end() -> None:
    from proxy.sim.gpu import SimulatedGpu

    gpu = SimulatedGpu(total_bytes=TOTAL)
    gpu.spawn("python", "python ComfyUI/main.py --listen", 12 * GIB)
    gpu.spawn("Xorg", "/usr/lib/xorg/Xorg :0", GIB)
    gpu.spawn("python", "python stt_relay.py", 2 * GIB)
    reg = registry()
    plan = plan_release(Attributor(reg).attribute(gpu.read()), reg, {}, "ollama", 14 * GIB)
    assert released(plan) == ["comfyui"] and plan.feasible
    assert sorted(reasons(plan).values()) == ["not_reclaimable", "unmanaged"]
