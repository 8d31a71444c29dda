"""The busy rule (proxy/handoff/busy.py) as a table: traffic, the engine's own queue, VRAM, whether
VRAM can be seen at all, and time in; one tenant's state out. Pure: nothing is read or written.

The cases of issue 27: an engine on the CPU (its VRAM is always 0) with a prompt longer than the
load grace, an engine outage shorter and longer than proxy.job_lost_after_s, the engine back."""

from __future__ import annotations

import sys

import pytest

from proxy.config.units import GIB
from proxy.handoff.busy import JOB_LOAD_GRACE_S, Evidence, QueueRead, busy_states, queue_rows, stale_jobs, tenant_state
from proxy.handoff.inflight import TenantTraffic
from proxy.handoff.plan import TenantState
from tests.json_reads import decisions_in
from tests.unit.cards import registry

REG = registry()
COMFY = REG.get("comfyui")
FLOOR = COMFY.idle_vram_bytes
NOW = 1000.0
LOST = 120.0  # proxy.job_lost_after_s


def traffic(in_flight: int = 0, jobs: tuple[str, ...] = (), last: float | None = 900.0,
            job_age: float | None = None) -> TenantTraffic:
    return TenantTraffic(in_flight, jobs, last, None if job_age is None else NOW - job_age)


ON_CARD = dict(observable=True)
ON_CPU = False  # observable: an engine on the CPU, or no GPU reader: VRAM proves nothing
OLD = JOB_LOAD_GRACE_S + 13.7  # a prompt running longer than the load grace (43.7 s, as observed)

# (case, traffic, evidence) -> (busy, reason, stale jobs, why)
CASES = [
    ("nothing seen", None, Evidence(FLOOR), False, "idle", (), ""),
    ("a request in flight, VRAM at its floor", traffic(1), Evidence(FLOOR), True, "1 GPU request(s) in flight", (), ""),
    ("a request in flight on a CPU engine", traffic(2), Evidence(0, observable=ON_CPU), True,
     "2 GPU request(s) in flight", (), ""),
    ("a relayed job with its load on the card", traffic(jobs=("p1",), job_age=OLD), Evidence(FLOOR + 6 * GIB),
     True, "1 running job(s)", (), ""),
    ("a relayed job whose load is on its way", traffic(jobs=("p1",), job_age=1), Evidence(FLOOR),
     True, "1 running job(s), load on its way", (), ""),
    ("on the card, past the grace, VRAM at its floor: stale", traffic(jobs=("p1",), job_age=OLD), Evidence(FLOOR),
     False, "1 job(s) listed but VRAM at its idle floor: stale", ("p1",), "vram"),
    ("on the CPU, a long prompt its queue lists: busy to its end", traffic(jobs=("p1",), job_age=OLD),
     Evidence(0, rows=("p1",), observable=ON_CPU), True, "1 running job(s), listed by its own queue", (), ""),
    ("on the CPU, no read since its traffic changed: still busy", traffic(jobs=("p1",), job_age=OLD),
     Evidence(0, rows=None, observable=ON_CPU), True, "1 running job(s)", (), ""),
    ("on the CPU, a fresh read that no longer lists it: stale", traffic(jobs=("p1",), job_age=OLD),
     Evidence(0, rows=("p9",), observable=ON_CPU), False, "1 job(s) listed but its own queue no longer lists them: stale",
     ("p1",), "unlisted"),
    ("an outage shorter than job_lost_after_s: still busy", traffic(jobs=("p1",), job_age=OLD),
     Evidence(FLOOR, unreachable_for=45.0), True, "1 running job(s); its queue has not answered for 45 s", (), ""),
    ("an outage longer than job_lost_after_s: stale, lost with the engine", traffic(jobs=("p1",), job_age=300),
     Evidence(FLOOR, unreachable_for=LOST), False, "1 job(s) listed but its queue has not answered for 120 s: stale",
     ("p1",), "unreachable"),
    ("the engine back, its queue lists the job again", traffic(jobs=("p1",), job_age=300),
     Evidence(0, rows=("p1",), observable=ON_CPU), True, "1 running job(s), listed by its own queue", (), ""),
    ("one prompt running, one pending: counted apart by its queue's running rows", traffic(jobs=("p1", "p2"), job_age=OLD),
     Evidence(FLOOR + 6 * GIB, rows=("p1",)), True, "1 running, 1 pending job(s)", (), ""),
    ("two prompts, no read to tell them apart", traffic(jobs=("p1", "p2"), job_age=OLD), Evidence(FLOOR + 6 * GIB),
     True, "2 job(s) running or pending", (), ""),
    ("rows of its own queue, VRAM above the floor (a client past the proxy)", traffic(), Evidence(FLOOR + GIB, rows=("q1", "q2")),
     True, "2 job(s) in its own queue and VRAM above its idle floor", (), ""),
    ("rows of its own queue at the floor on the card: stale", traffic(), Evidence(FLOOR, rows=("q1",)),
     False, "1 job(s) listed but VRAM at its idle floor: stale", ("q1",), "vram"),
    ("rows of its own queue on the CPU: a fresh read is evidence enough", traffic(), Evidence(0, rows=("q1",), observable=ON_CPU),
     True, "1 job(s) in its own queue", (), ""),
]


@pytest.mark.parametrize(("case", "seen", "ev", "is_busy", "reason", "stale", "why"), CASES, ids=[c[0] for c in CASES])
def test_busy_rule(case: str, seen: TenantTraffic | None, ev: Evidence, is_busy: bool, reason: str,
                   stale: tuple[str, ...], why: str) -> None:
    state = tenant_state(COMFY, seen, ev, NOW, LOST)
    assert (state.busy, state.busy_reason, state.stale_jobs, state.stale_why) == (is_busy, reason, stale, why), case


def test_a_queue_read_older_than_the_last_traffic_change_is_not_believed() -> None:
    seen = traffic(last=500.0)
    assert queue_rows(QueueRead(499.0, ("q1",)), seen, lambda job: False) is None, "read before the end marker passed"
    assert queue_rows(QueueRead(501.0, ("q1", "q2")), seen, lambda job: job == "q2") == ("q1",), \
        "a job the proxy saw end is not counted however the queue lists it"
    assert queue_rows(None, seen, lambda job: False) is None


def test_busy_states_covers_every_tenant_and_changes_nothing() -> None:
    seen = {"comfyui": traffic(jobs=("p1",), job_age=60)}
    reads = {"comfyui": QueueRead(950.0, ("p1", "p2"))}
    before = (dict(seen), dict(reads))
    states = busy_states(REG, seen, reads, lambda tenant, job: False, lambda name: FLOOR, NOW)
    assert set(states) == {t.name for t in REG}
    assert stale_jobs(states) == {"comfyui": ["p1", "p2"]} and not states["ollama"].busy
    assert (seen, reads) == before, "the busy rule writes nothing"


def test_on_the_cpu_the_same_reads_make_the_prompt_busy() -> None:
    seen = {"comfyui": traffic(jobs=("p1",), job_age=60)}
    reads = {"comfyui": QueueRead(950.0, ("p1",))}
    on_card = busy_states(REG, seen, reads, lambda t, j: False, lambda name: 0, NOW)
    on_cpu = busy_states(REG, seen, reads, lambda t, j: False, lambda name: 0, NOW, observable=lambda name: False)
    assert not on_card["comfyui"].busy, "on the card, 0 bytes past the grace says the prompt is not running"
    assert on_cpu["comfyui"].busy, "on the CPU the card says nothing: the queue's listing decides"


def test_an_engine_silent_since_a_time_is_judged_against_job_lost_after_s() -> None:
    seen = {"comfyui": traffic(jobs=("p1",), job_age=300)}

    def judged(silent_s: float) -> dict[str, TenantState]:
        return busy_states(REG, seen, {}, lambda t, j: False, lambda name: FLOOR + GIB, NOW,
                           unreachable_since={"comfyui": NOW - silent_s}, job_lost_after_s=LOST)

    short, long = judged(60), judged(121)
    assert short["comfyui"].busy and not long["comfyui"].busy and long["comfyui"].stale_why == "unreachable"


async def test_the_scheduler_judges_a_cpu_engine_by_its_queue_and_ends_jobs_of_an_engine_gone_for_good() -> None:
    """The wiring: what the watchdog learns (the engine's device, its queue reads, silence) reaches the rule."""
    from proxy.clock import ManualClock
    from proxy.handoff.broker import GpuBroker
    from proxy.handoff.decisions import DecisionLog
    from proxy.handoff.inflight import InFlight
    from proxy.sim.gpu import SimulatedGpu

    clock = ManualClock()
    inflight = InFlight(clock)
    broker = GpuBroker(REG, SimulatedGpu(), inflight, clock, DecisionLog(clock))
    try:
        inflight.track_job("comfyui", "p1")
        await clock.advance(JOB_LOAD_GRACE_S + 13.7)
        broker.scheduler.queue_read("comfyui", clock.now(), ("p1",))  # ComfyUI's /queue lists the prompt running
        snap = await broker.snapshot()
        assert not broker.scheduler.states(snap)["comfyui"].busy, \
            "on the card, a prompt holding nothing past the grace is stale"
        broker.scheduler.on_cpu("comfyui", True)
        assert broker.scheduler.states(snap)["comfyui"].busy, "a --cpu ComfyUI's running prompt is reported idle at 43.7 s"
        broker.scheduler.queue_read("comfyui", clock.now(), None)  # the engine stops answering
        await clock.advance(REG.config.proxy.job_lost_after_s - 1)
        assert broker.scheduler.states(snap)["comfyui"].busy, "an outage shorter than job_lost_after_s keeps the job busy"
        await clock.advance(1)
        state = broker.scheduler.states(snap)["comfyui"]
        assert not state.busy and state.stale_why == "unreachable" and state.stale_jobs == ("p1",)
    finally:
        await broker.aclose()


async def test_the_watchdog_ends_the_jobs_of_an_engine_silent_past_job_lost_after_s() -> None:
    import socket

    from proxy.clock import ManualClock
    from proxy.engines import AdapterCache
    from proxy.handoff.broker import GpuBroker
    from proxy.handoff.decisions import DecisionLog
    from proxy.handoff.inflight import InFlight
    from proxy.handoff.watchdog import Watchdog
    from proxy.sim.gpu import SimulatedGpu

    with socket.socket() as s:  # a port nothing listens on: the engine is down
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    reg = registry({"comfyui": {"upstream": down}, "ollama": {"upstream": down}}, proxy={"job_lost_after_s": 60})
    clock = ManualClock()
    inflight = InFlight(clock)
    log = DecisionLog(clock)
    engines = AdapterCache()
    broker = GpuBroker(reg, SimulatedGpu(), inflight, clock, log, adapter=engines)
    try:
        inflight.track_job("comfyui", "p1")
        await Watchdog(broker, engines).tick()  # the first failed read: silent since now
        assert inflight.jobs("comfyui") == ("p1",)
        await clock.advance(60)
        report = await Watchdog(broker, engines).tick()
        assert inflight.jobs("comfyui") == (), "a job lost with an engine that never comes back is never ended"
        (lost,) = decisions_in(log, "stale_job")
        assert lost.outcome["job_id"] == "p1" and "job_lost_after_s" in lost.outcome["reason"]
        assert any("p1 ended" in a for a in report.actions)
    finally:
        await broker.aclose()


def test_an_open_connection_keeps_a_tenant_released_by_stopping_busy_but_not_one_released_by_a_call() -> None:
    """A stop would cut a stream or websocket (invariant 7): a tenant whose release stops it is busy
    while one is open, so a plan waits for it instead of ordering a stop that is refused again and
    again. A tenant released by a call (ComfyUI's /free) keeps serving: an open UI socket is no work."""
    app = registry({"stt": {"engine": "generic", "upstream": "http://127.0.0.1:9", "needs_vram_gb": 3.0,
                            "release": {"kind": "process", "command": [sys.executable, "-c", "pass"]}}}).get("stt")
    assert app.lifecycle is not None, "the copy is a process tenant"
    streaming = TenantTraffic(0, (), 900.0, None, connections=1)
    state = tenant_state(app, streaming, Evidence(3 * GIB), NOW)
    assert state.busy and "a stop would cut them" in state.busy_reason, state
    assert not tenant_state(app, TenantTraffic(0, (), 900.0), Evidence(3 * GIB), NOW).busy, "no connection: idle"
    assert not tenant_state(COMFY, streaming, Evidence(FLOOR + GIB), NOW).busy, "a /free leaves its sockets alone"


def test_states_on_demand_are_worked_out_only_for_a_plan_short_of_memory_and_decide_the_same() -> None:
    from proxy.handoff.busy import StatesOnDemand
    from proxy.handoff.plan import plan_release
    from tests.unit.cards import busy, idle, snap

    eager = busy(idle("comfyui"), "comfyui", "prompt abc running")
    calls: list[int] = []

    def compute() -> dict[str, TenantState]:
        calls.append(1)
        return eager

    roomy = snap([("comfyui", 2, 10 * GIB)], free=12 * GIB)
    lazy = StatesOnDemand(compute)
    assert plan_release(roomy, registry(), lazy, "ollama", 8 * GIB) == plan_release(roomy, registry(), eager, "ollama", 8 * GIB)
    assert not lazy.computed and calls == []  # room on the reading: nobody's busy state was looked at
    short = snap([("comfyui", 2, 10 * GIB)], free=2 * GIB)
    lazy = StatesOnDemand(compute)
    assert plan_release(short, registry(), lazy, "ollama", 8 * GIB) == plan_release(short, registry(), eager, "ollama", 8 * GIB)
    assert lazy.computed and calls == [1]  # short: worked out once, the same states as the eager pass
    assert dict(lazy) == eager and len(lazy) == len(eager)


def test_a_roomy_resident_plan_is_kept_for_the_same_reading_and_promises_only() -> None:
    from proxy.handoff.per_card import plan_on_devices
    from proxy.handoff.policy import RoomyPlans, resident_fit
    from tests.unit.cards import idle, snap

    reading = snap([("ollama", 1, 5 * GIB), ("comfyui", 2, 10 * GIB)], free=6 * GIB)
    tenants = registry()
    fresh = resident_fit(plan_on_devices(reading, tenants, idle(), "ollama", 8 * GIB, promised={}))
    plans = RoomyPlans()
    key = ("ollama", 8 * GIB, ())
    assert plans.find(reading, tenants, key) is None
    plans.keep(reading, tenants, key, fresh)
    assert plans.find(reading, tenants, key) == fresh
    assert "on the card already, room for its peak" in fresh.explanation and not fresh.releases
    assert plans.find(reading, tenants, ("ollama", 8 * GIB, (("comfyui", GIB),))) is None  # other promises: planned again
    again = snap([("ollama", 1, 5 * GIB), ("comfyui", 2, 10 * GIB)], free=6 * GIB)
    assert plans.find(again, tenants, key) is None  # a new reading, even an equal one: planned on it
    assert plans.find(reading, tenants, key) is None  # the old reading's plans are forgotten
    plans.keep(reading, tenants, key, fresh)
    assert plans.find(reading, registry(), key) is None  # a reloaded registry (a tenant may have moved): planned again
