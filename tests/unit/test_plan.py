"""The release planner: pure data in, a Plan out. No sockets, no clock."""

from __future__ import annotations

import json

from proxy.config.units import GIB
from proxy.gpu.attribution import Attributor
from proxy.handoff.plan import Plan, plan_release, starved
from proxy.handoff.plan_json import plan_json
from tests.unit.cards import STT, TOTAL, busy, idle, registry, snap


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
                                "(idle, priority 40 below the requester's 50) to free 6.50 GiB")
    assert plan.outcome == "release" and plan.possible


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


def test_idle_memory_of_a_higher_priority_tenant_serves_a_lower_requester() -> None:
    reg = registry({"other": {**STT, "priority": 60}})
    s = snap([("other", 5, 6 * GIB)], free=1 * GIB)
    plan = plan_release(s, reg, idle("other"), "ollama", 4 * GIB)
    assert released(plan) == ["other"] and plan.feasible, plan.explanation
    assert plan.releases[0].reason == "idle; priority 60, above the requester's 50, does not protect idle memory"


def test_protect_idle_memory_keeps_it_from_lower_priority_requesters_only() -> None:
    reg = registry({"other": {**STT, "priority": 60, "protect_idle_memory": True}})
    s = snap([("other", 5, 6 * GIB)], free=1 * GIB)
    plan = plan_release(s, reg, idle("other"), "ollama", 4 * GIB)
    assert plan.releases == () and not plan.possible
    assert reasons(plan) == {5: "protected"}
    assert "protect_idle_memory" in plan.blockers[0].detail
    # a requester above it may still take it
    reg = registry({"other": {**STT, "priority": 40, "protect_idle_memory": True}})
    assert released(plan_release(s, reg, idle("other"), "ollama", 4 * GIB)) == ["other"]


def test_relief_of_a_starved_busy_tenant_takes_only_from_tenants_below_it() -> None:
    reg = registry({"other": {**STT, "priority": 50}})
    s = snap([("other", 5, 6 * GIB), ("comfyui", 2, 3 * GIB)], free=1 * GIB)
    plan = plan_release(s, reg, idle("other", "comfyui"), "ollama", 6 * GIB, mode="relief")
    assert released(plan) == ["comfyui"] and not plan.feasible
    assert reasons(plan)[5] == "not_lower_priority"


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
    assert not plan.feasible and not plan.possible
    assert released(plan) == [], "a release expected to free 0 bytes is not made"
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


def test_a_middle_priority_requester_takes_idle_memory_from_above_too_but_only_what_it_needs() -> None:
    reg = registry({"stt": STT})
    s = snap([("comfyui", 2, 4 * GIB + GIB // 2), ("ollama", 1, 6 * GIB)], free=GIB)
    plan = plan_release(s, reg, idle("comfyui", "ollama"), "stt", 7 * GIB)
    # comfyui (40) first frees 4 GiB, still short; ollama (50) frees 6 GiB, which alone is enough: comfyui is dropped
    assert released(plan) == ["ollama"] and plan.feasible, plan.explanation


def test_priority_chain_decides_the_order_and_the_relief_of_a_busy_tenant() -> None:
    reg = registry({"stt": STT, "batch": {**STT, "priority": 30, "match": {"cmdline_patterns": ["batch"]}}})
    s = snap([("batch", 7, 3 * GIB), ("comfyui", 2, 4 * GIB + GIB // 2), ("stt", 3, 3 * GIB)], free=0)
    states = busy(idle("comfyui", "stt"), "batch")
    plan = plan_release(s, reg, states, "ollama", 6 * GIB)
    assert released(plan) == ["comfyui", "stt"]  # batch (30) is busy, so skip to 40 then 45
    assert reasons(plan) == {7: "busy"}
    # comfyui asking for itself: stt's idle memory serves it
    plan = plan_release(s, reg, states, "comfyui", 6 * GIB)
    assert released(plan) == ["stt"] and plan.feasible
    # the watchdog relieving comfyui in the background: only batch is below it, and it is busy
    plan = plan_release(s, reg, states, "comfyui", 6 * GIB, mode="relief")
    assert released(plan) == [] and not plan.feasible and plan.possible and plan.wait_for == ("batch",)
    assert reasons(plan) == {7: "busy", 3: "not_lower_priority", 2: "requester"}


def test_release_the_final_plan_does_not_need_is_dropped() -> None:
    # issue 13.14: b 1 GiB at priority 0, c 4 GiB at priority 1, 3 GiB short: only c
    reg = registry({"b": {**STT, "priority": 0, "match": {"cmdline_patterns": ["^b"]}},
                    "c": {**STT, "priority": 1, "match": {"cmdline_patterns": ["^c"]}}})
    s = snap([("b", 1, GIB), ("c", 2, 4 * GIB)], free=GIB)
    plan = plan_release(s, reg, idle("b", "c"), "ollama", 4 * GIB)
    assert released(plan) == ["c"] and plan.feasible


def test_memory_held_by_a_busy_tenant_is_waited_for_not_refused() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    plan = plan_release(s, registry(), busy(idle(), "comfyui", "1 running job(s)"), "ollama", 16 * GIB)
    assert not plan.feasible and plan.possible and plan.outcome == "wait"
    assert plan.wait_for == ("comfyui",) and plan.releases == ()
    assert "waits for busy comfyui (1 running job(s)" in plan.explanation


def test_a_plan_that_waits_lists_the_idle_releases_it_counts_on() -> None:
    # issue 27.6: stt idle with 3 GiB, comfyui busy with 10 GiB, 1 GiB free, ollama needs 8 GiB: the
    # plan waits for comfyui and already counts stt's 3 GiB ("short by 4.00 GiB" = 7 - 3), so stt is
    # in its releases, not left out of both releases and blockers
    reg = registry({"stt": STT})
    s = snap([("comfyui", 2, 10 * GIB), ("stt", 3, 3 * GIB)], free=GIB)
    plan = plan_release(s, reg, busy(idle("stt"), "comfyui", "1 running job(s)"), "ollama", 8 * GIB)
    assert plan.outcome == "wait" and plan.wait_for == ("comfyui",)
    assert released(plan) == ["stt"], f"stt's idle 3 GiB is counted on but not listed: {plan_json(plan)}"
    assert reasons(plan) == {2: "busy"}
    assert plan.explanation == ("ollama needs 8.00 GiB, 1.00 GiB free: short by 4.00 GiB; "
                                "waits for busy comfyui (1 running job(s), 9.50 GiB above its floor) to finish")
    listed = {pid for r in plan.releases for pid in r.pids} | {b.pid for b in plan.blockers}
    assert listed == {2, 3}, f"every holder released or named, got {listed}"


def test_only_what_waiting_cannot_reach_is_impossible() -> None:
    s = snap([("comfyui", 2, 7 * GIB), ("unmanaged", 9, 6 * GIB)], free=8 * GIB)
    states = busy(idle(), "comfyui")
    assert plan_release(s, registry(), states, "ollama", 14 * GIB).outcome == "wait"
    plan = plan_release(s, registry(), states, "ollama", 16 * GIB)
    assert plan.outcome == "impossible" and plan.wait_for == ()
    assert reasons(plan) == {2: "busy", 9: "unmanaged"}
    assert plan.reachable_bytes == 8 * GIB + 7 * GIB - GIB // 2
    assert "even if every reclaimable tenant were released" in plan.explanation


def test_memory_promised_to_admitted_loads_is_not_free() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    assert plan_release(s, registry(), idle("comfyui"), "ollama", 8 * GIB).outcome == "ready"
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 8 * GIB, promised={"stt": 4 * GIB})
    assert plan.outcome == "release" and released(plan) == ["comfyui"]
    assert plan.promised_bytes == 4 * GIB


def test_plan_is_json_serialisable_with_gib_for_people_and_bytes() -> None:
    s = snap([("comfyui", 2, 7 * GIB), ("desktop", 3, GIB)], free=3 * GIB)
    plan = plan_release(s, registry(), idle("comfyui"), "ollama", 8 * GIB)
    body = json.loads(json.dumps(plan_json(plan)))
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
