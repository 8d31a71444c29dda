"""Plans and the handoff queue's decisions on a host with several GPUs: pure data in, verdicts out.

Each card is planned alone (its figures, the process entries on it), with the arbiter's own
`plan_release` and `schedule`; a one-card snapshot goes straight to them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.config.units import GIB
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
from proxy.gpu.placement import Placement
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot
from proxy.gpu.visibility import Card, Device, TenantDevices
from proxy.handoff.orders import release_whole
from proxy.handoff.per_card import candidates, free_for, plan_on_devices, schedule_on_devices
from proxy.handoff.plan import Plan, plan_release
from proxy.handoff.plan_json import plan_json
from proxy.handoff.policy import schedule
from tests.unit.cards import RESERVED, busy, idle, registry, snap
from tests.unit.test_scheduler import actions, waiter

SIZES = {0: 24 * GIB, 1: 16 * GIB}


def two_cards(procs: Sequence[tuple[str, int, int, int]],
              placed: Mapping[str, tuple[int, ...] | None] | None = None) -> AttributedSnapshot:
    """procs: (tenant, pid, used bytes, card). Card 0 holds 24 GiB, card 1 16 GiB; free is what is not held."""
    devices = []
    for index, total in SIZES.items():
        held = sum(u for _, _, u, d in procs if d == index)
        devices.append(DeviceMemory(index, f"card {index}", total, RESERVED, held + RESERVED, total - RESERVED - held,
                                    uuid=f"GPU-{index}aaa"))
    gps = tuple(GpuProcess(pid, f"{t}-proc", f"{t} --serve", used, float(pid), device=d) for t, pid, used, d in procs)
    raw = GpuSnapshot(devices[0], gps, source="simulated", devices=tuple(devices))
    placement = {t: Placement(t, devs, "pinned" if devs is not None else "any", "test")
                 for t, devs in (placed or {}).items()}
    return AttributedSnapshot(raw, tuple(AttributedProcess(p, t) for p, (t, *_) in zip(gps, procs, strict=True)), placement)


def released(plan: Plan) -> list[str]:
    return [r.tenant for r in plan.releases]


def test_a_load_on_one_card_releases_only_idle_tenants_on_that_card() -> None:
    reg = registry({"stt": {"engine": "generic", "match": {"cmdline_patterns": ["stt"]}, "priority": 10,
                            "release": {"kind": "http", "url": "/release"}}})
    s = two_cards([("ollama", 1, 20 * GIB, 0), ("stt", 2, 6 * GIB, 1), ("comfyui", 3, GIB, 1)],
                  {"ollama": (0,), "comfyui": (1,), "stt": (1,)})
    plan = plan_on_devices(s, reg, idle("ollama", "stt", "comfyui"), "comfyui", 12 * GIB)
    assert plan.feasible and plan.device == 1, plan.explanation
    assert released(plan) == ["stt"], "only the card ComfyUI loads on gives memory back"
    assert all(b.tenant != "ollama" for b in plan.blockers), "a tenant on another card is never in the way"
    assert plan.explanation.startswith("GPU 1 (card 1): ")
    assert plan_json(plan)["device"] == {"index": 1, "name": "card 1"}


def test_free_memory_on_another_card_cannot_serve_a_load() -> None:
    s = two_cards([("comfyui", 3, GIB, 1)], {"comfyui": (1,)})  # card 0 is empty: 23.7 GiB free there
    plan = plan_on_devices(s, registry(), idle("comfyui"), "comfyui", 20 * GIB)
    assert not plan.possible and plan.outcome == "impossible" and plan.device == 1
    assert "too large for this card" in plan.explanation and plan.explanation.startswith("GPU 1")


def test_an_unplaced_tenant_is_planned_on_the_card_where_it_is_ready() -> None:
    s = two_cards([("comfyui", 3, 20 * GIB, 0)])  # card 0 nearly full of idle ComfyUI, card 1 empty
    plan = plan_on_devices(s, registry(), idle("comfyui", "ollama"), "ollama", 8 * GIB)
    assert candidates(s, "ollama") == (0, 1)
    assert plan.device == 1 and plan.outcome == "ready", plan.explanation
    assert free_for(s, "ollama") == 16 * GIB - RESERVED


def test_an_unplaced_tenant_takes_the_card_where_a_release_helps_over_one_where_it_must_wait() -> None:
    s = two_cards([("comfyui", 3, 20 * GIB, 0), ("stt", 4, 12 * GIB, 1)])
    states = busy(idle("comfyui", "ollama"), "stt", "transcribing")
    reg = registry({"stt": {"engine": "generic", "match": {"cmdline_patterns": ["stt"]}, "priority": 10,
                            "release": {"kind": "http", "url": "/release"}}})
    plan = plan_on_devices(s, reg, states, "ollama", 8 * GIB)
    assert plan.device == 0 and released(plan) == ["comfyui"], plan.explanation


def test_relief_on_one_card_takes_nothing_from_the_other() -> None:
    s = two_cards([("ollama", 1, 10 * GIB, 0), ("comfyui", 3, 12 * GIB, 1)], {"ollama": (0,), "comfyui": (1,)})
    plan = plan_on_devices(s, registry(), idle("ollama", "comfyui"), "ollama", 26 * GIB, mode="relief")
    assert plan.device == 0 and not plan.possible and released(plan) == []


def test_one_card_plans_are_the_arbiters_own() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=3 * GIB)
    states = idle("comfyui")
    assert plan_on_devices(s, registry(), states, "ollama", 8 * GIB) == plan_release(s, registry(), states, "ollama", 8 * GIB)
    assert "device" not in plan_json(plan_on_devices(s, registry(), states, "ollama", 8 * GIB))
    whole = release_whole(s, registry().get("comfyui"), "admin", "release", "asked")
    assert whole.held_by_device == {} and TenantDevices.of(s, "comfyui") is None
    assert "devices" not in Device.of(s).model_dump(mode="json", exclude_unset=True)


def test_one_card_schedule_is_the_arbiters_own() -> None:
    s = snap([("comfyui", 2, 10 * GIB)], free=2 * GIB)
    ws = [waiter("ollama", 8, at=0), waiter("comfyui", 1, at=1)]
    states = busy(idle(), "comfyui")
    assert schedule_on_devices(s, registry(), states, ws, {}, 5, 60) == schedule(s, registry(), states, ws, {}, 5, 60)


def test_a_waiter_for_a_busy_card_does_not_hold_up_a_load_on_the_other_card() -> None:
    s = two_cards([("comfyui", 3, 14 * GIB, 1)], {"ollama": (0,), "comfyui": (1,), "stt": (1,)})
    states = busy(idle("ollama"), "comfyui", "prompt running")
    stt, chat = waiter("stt", 4, at=0, priority=90), waiter("ollama", 8, at=1)
    verdicts = schedule_on_devices(s, registry({"stt": {"engine": "generic", "priority": 90}}), states,
                                   [chat, stt], {}, 5, 60)
    assert actions(verdicts) == [("stt", "wait"), ("ollama", "run")], "queue order kept, each card decided alone"
    assert [v.plan.device for v in verdicts] == [1, 0]
    assert verdicts[0].plan.wait_for == ("comfyui",)


def test_memory_promised_on_one_card_is_not_counted_on_the_other() -> None:
    s = two_cards([], {"ollama": (0,), "comfyui": (1,)})
    promised = {"ollama:big": ("ollama", 22 * GIB)}  # a load under way on card 0
    verdicts = schedule_on_devices(s, registry(), idle("ollama", "comfyui"), [waiter("comfyui", 12)], promised, 0, 60)
    assert actions(verdicts) == [("comfyui", "run")] and verdicts[0].plan.promised_bytes == 0
    plan = plan_on_devices(s, registry(), idle(), "ollama", 4 * GIB, promised={"ollama": 22 * GIB})
    assert plan.promised_bytes == 22 * GIB and plan.outcome == "wait"


def test_views_show_memory_per_card_and_where_each_tenant_loads() -> None:
    s = two_cards([("ollama", 1, 10 * GIB, 0), ("ollama", 1, 2 * GIB, 1), ("comfyui", 3, 5 * GIB, 1)],
                  {"ollama": None, "comfyui": (1,)})
    cards = Card.all_of(s)
    assert [c.tenants for c in cards] == [{"ollama": 10 * GIB}, {"ollama": 2 * GIB, "comfyui": 5 * GIB}]
    assert cards[1].placed == ["comfyui"]
    whole = Device.of(s)
    assert whole.total_bytes == 40 * GIB and whole.name.startswith("2 GPUs")
    view = TenantDevices.of(s, "ollama")
    assert view is not None and view.devices is None and view.source == "any"
    assert [d.vram_bytes for d in view.vram_by_device] == [10 * GIB, 2 * GIB]
    assert release_whole(s, registry().get("ollama"), "admin", "release", "asked").held_by_device == {0: 10 * GIB, 1: 2 * GIB}
    assert s.held_by("ollama") == 12 * GIB and s.on_device(1).held_by("ollama") == 2 * GIB
