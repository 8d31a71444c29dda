"""The busy rule (proxy/handoff/busy.py) as a table: traffic, the engine's own queue, VRAM and time in,
one tenant's state out. Pure: nothing is read or written."""

from __future__ import annotations

import sys

import pytest
from cards import registry

from proxy.handoff.busy import JOB_LOAD_GRACE_S, QueueRead, busy_states, queue_rows, stale_jobs, tenant_state
from proxy.handoff.inflight import TenantTraffic
from proxy.tenants import GIB

REG = registry()
COMFY = REG.get("comfyui")
FLOOR = COMFY.idle_vram_bytes
NOW = 1000.0


def traffic(in_flight: int = 0, jobs: tuple[str, ...] = (), last: float | None = 900.0,
            newest_job_at: float | None = None) -> TenantTraffic:
    return TenantTraffic(in_flight, jobs, last, newest_job_at)


# (case, traffic, own queue rows, held bytes) -> (busy, reason, stale jobs)
CASES = [
    ("nothing seen", None, (), FLOOR, False, "idle", ()),
    ("a request in flight, VRAM at its floor", traffic(1), (), FLOOR, True, "1 GPU request(s) in flight", ()),
    ("a request in flight on a CPU engine (holds nothing)", traffic(2), (), 0, True, "2 GPU request(s) in flight", ()),
    ("a relayed job with its load on the card", traffic(jobs=("p1",), newest_job_at=990.0), (), FLOOR + 6 * GIB,
     True, "1 running job(s)", ()),
    ("a relayed job whose load is on its way", traffic(jobs=("p1",), newest_job_at=NOW - 1), (), FLOOR,
     True, "1 running job(s), load on its way", ()),
    ("a relayed job past the grace with VRAM at its floor: stale",
     traffic(jobs=("p1",), newest_job_at=NOW - JOB_LOAD_GRACE_S), (), FLOOR, False,
     "1 job(s) listed but VRAM at its idle floor: stale", ("p1",)),
    ("rows of its own queue with VRAM above the floor (a client past the proxy)", traffic(), ("q1", "q2"),
     FLOOR + GIB, True, "2 job(s) in its own queue and VRAM above its idle floor", ()),
    ("rows of its own queue at the floor: stale", traffic(), ("q1",), FLOOR, False,
     "1 job(s) listed but VRAM at its idle floor: stale", ("q1",)),
    ("a relayed job also listed by its queue counts once", traffic(jobs=("p1",), newest_job_at=NOW - 1), ("p1",), FLOOR,
     True, "1 running job(s), load on its way", ()),
    ("the engine down (no queue read) with a relayed job past the grace", traffic(jobs=("p1",), newest_job_at=NOW - 60),
     (), 0, False, "1 job(s) listed but VRAM at its idle floor: stale", ("p1",)),
]


@pytest.mark.parametrize(("case", "seen", "rows", "held", "is_busy", "reason", "stale"), CASES, ids=[c[0] for c in CASES])
def test_busy_rule(case: str, seen: TenantTraffic | None, rows: tuple[str, ...], held: int, is_busy: bool,
                   reason: str, stale: tuple[str, ...]) -> None:
    state = tenant_state(COMFY, seen, rows, held, NOW)
    assert (state.busy, state.busy_reason, state.stale_jobs) == (is_busy, reason, stale), case


def test_a_queue_read_older_than_the_last_traffic_change_is_not_believed() -> None:
    seen = traffic(last=500.0)
    assert queue_rows(QueueRead(499.0, ("q1",)), seen, lambda job: False) == (), "read before the end marker passed"
    assert queue_rows(QueueRead(501.0, ("q1", "q2")), seen, lambda job: job == "q2") == ("q1",), \
        "a job the proxy saw end is not counted however the queue lists it"
    assert queue_rows(None, seen, lambda job: False) == ()


def test_busy_states_covers_every_tenant_and_changes_nothing() -> None:
    seen = {"comfyui": traffic(jobs=("p1",), newest_job_at=NOW - 60)}
    reads = {"comfyui": QueueRead(950.0, ("p1", "p2"))}
    before = (dict(seen), dict(reads))
    states = busy_states(REG, seen, reads, lambda tenant, job: False, lambda name: FLOOR, NOW)
    assert set(states) == {t.name for t in REG}
    assert stale_jobs(states) == {"comfyui": ["p1", "p2"]} and not states["ollama"].busy
    assert (seen, reads) == before, "the busy rule writes nothing"


def test_an_open_connection_keeps_a_tenant_released_by_stopping_busy_but_not_one_released_by_a_call() -> None:
    """A stop would cut a stream or websocket (invariant 7): a tenant whose release stops it is busy
    while one is open, so a plan waits for it instead of ordering a stop that is refused again and
    again. A tenant released by a call (ComfyUI's /free) keeps serving: an open UI socket is no work."""
    app = registry({"stt": {"engine": "generic", "upstream": "http://127.0.0.1:9", "needs_vram_gb": 3.0,
                            "release": {"kind": "process", "command": [sys.executable, "-c", "pass"]}}}).get("stt")
    assert app.lifecycle is not None, "the copy is a process tenant"
    streaming = TenantTraffic(0, (), 900.0, None, connections=1)
    state = tenant_state(app, streaming, (), 3 * GIB, NOW)
    assert state.busy and "a stop would cut them" in state.busy_reason, state
    assert not tenant_state(app, TenantTraffic(0, (), 900.0), (), 3 * GIB, NOW).busy, "no connection: idle"
    assert not tenant_state(COMFY, streaming, (), FLOOR + GIB, NOW).busy, "a /free leaves its sockets alone"
