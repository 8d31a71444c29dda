"""The telemetry store: durable writes off the loop, bounded retention, downsampling, inferred loads."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest

from proxy.admin.telemetry import Telemetry, TelemetryStore, VramRecorder, default_path
from proxy.admin.telemetry_rows import decision_rows
from proxy.clock import ManualClock
from proxy.config.units import GIB, MIB
from proxy.decision_base import RequestTrigger
from proxy.handoff.decisions import (
    DecisionLog,
    HandoffFinished,
    HandoffStarted,
    ModelLoad,
    OomRetry,
    Rejected,
    ReleaseResult,
    StaleJob,
)
from proxy.handoff.plan import Blocker, Plan

if TYPE_CHECKING:
    from proxy.service import Proxy


def store_at(tmp_path: Path, clock: ManualClock | None = None, **kw: Any) -> TelemetryStore:
    store = TelemetryStore(tmp_path / "t.sqlite3", wall=clock or ManualClock(), **kw)
    store.open()
    return store


def oom_row(i: int, at: float = 1_796_000_000.0) -> dict[str, object]:
    return {"at": at, "decision_id": i, "tenant": "ollama", "result": "succeeded"}


def test_rows_submitted_just_before_close_are_all_written(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    for i in range(1000):
        assert store.submit("oom_retries", oom_row(i))
    store.close()

    reopened = TelemetryStore(tmp_path / "t.sqlite3")
    assert reopened.count("oom_retries") == 1000, "rows queued before close were lost"
    assert store.dropped == 0


def test_submit_after_close_is_dropped_and_counted(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.close()
    assert store.submit("oom_retries", oom_row(1)) is False
    assert store.dropped == 1


def test_a_full_queue_drops_rows_instead_of_blocking(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path / "t.sqlite3", queue_max=3)  # not opened: nothing drains the queue
    results = [store.submit("oom_retries", oom_row(i)) for i in range(5)]
    assert results == [True, True, True, False, False]
    assert store.dropped == 2


def test_query_reads_back_rows_since_a_time_oldest_first(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    for i, at in enumerate((100.0, 200.0, 300.0)):
        store.submit("oom_retries", oom_row(i, at))
    assert store.flush()
    rows = store.query("oom_retries", since=150.0)
    assert [(r["at"], r["decision_id"]) for r in rows] == [(200.0, 1), (300.0, 2)]
    assert [r["decision_id"] for r in store.query("oom_retries", limit=1)] == [2], "limit keeps the newest"
    store.close()


def test_rows_older_than_retention_are_deleted_on_open(tmp_path: Path) -> None:
    clock = ManualClock()
    now = clock.wall()
    store = store_at(tmp_path, clock, retention_days=7)
    store.submit("oom_retries", oom_row(1, now - 8 * 86400))
    store.submit("oom_retries", oom_row(2, now - 1 * 86400))
    store.close()

    again = store_at(tmp_path, clock, retention_days=7)
    assert [r["decision_id"] for r in again.query("oom_retries")] == [2]
    again.close()


def test_each_table_keeps_at_most_max_rows_newest(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_rows=10)
    for i in range(25):
        store.submit("oom_retries", oom_row(i))
    store.close()
    again = store_at(tmp_path, max_rows=10)
    assert [r["decision_id"] for r in again.query("oom_retries")] == list(range(15, 25))
    again.close()


def test_a_failing_write_is_counted_and_the_writer_keeps_going(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    conn = sqlite3.connect(tmp_path / "t.sqlite3")
    conn.execute("DROP TABLE oom_retries")
    conn.commit()
    conn.close()
    store.submit("oom_retries", oom_row(1))
    assert store.flush()
    assert store.last_error is not None and "oom_retries" in store.last_error
    store.submit("decisions", {"at": 1.0, "decision_id": 1, "kind": "plan", "tenant": "t", "trigger": "x", "outcome": "{}"})
    assert store.flush() and store.alive
    assert store.last_error is None and store.dropped == 1
    assert store.count("decisions") == 1
    store.close()


async def test_vram_is_downsampled_to_one_row_per_tenant_per_window(tmp_path: Path) -> None:
    clock = ManualClock(start=1000.0, wall_start=1_796_000_000.0)  # wall aligned to a 10 s window
    store = store_at(tmp_path, clock)
    rec = VramRecorder(store, clock, window_s=10.0)
    for held in (3 * GIB, 1 * GIB, 2 * GIB):
        rec.observe("comfyui", held)
        await clock.advance(3.0)
    rec.observe("comfyui", 5 * GIB)  # t = 9 s: same window
    await clock.advance(2.0)
    rec.observe("comfyui", 4 * GIB)  # t = 11 s: next window closes the first
    assert store.flush()
    rows = store.query("vram")
    assert len(rows) == 1
    assert {k: rows[0][k] for k in ("tenant", "samples", "min_bytes", "max_bytes", "last_bytes", "at")} == {
        "tenant": "comfyui", "samples": 4, "min_bytes": 1 * GIB, "max_bytes": 5 * GIB, "last_bytes": 5 * GIB,
        "at": 1_796_000_000.0}
    rec.flush()
    assert store.flush() and len(store.query("vram")) == 2, "flush writes the open window"
    store.close()


async def test_min_vram_is_the_smallest_sample_inside_the_window() -> None:
    clock = ManualClock()
    rec = VramRecorder(None, clock)
    assert rec.min_vram("comfyui", 60.0) is None, "no samples: unknown, not zero"
    rec.observe("comfyui", 400 * MIB)
    await clock.advance(100.0)
    rec.observe("comfyui", 12 * GIB)
    await clock.advance(10.0)
    rec.observe("comfyui", 11 * GIB)
    assert rec.min_vram("comfyui", 60.0) == 11 * GIB
    assert rec.min_vram("comfyui", 200.0) == 400 * MIB


async def test_vram_growth_across_samples_is_recorded_as_one_model_load_with_its_speed(tmp_path: Path) -> None:
    clock = ManualClock()
    store = store_at(tmp_path, clock)
    rec = VramRecorder(store, clock)
    for held in (0, 4 * GIB, 8 * GIB, 10 * GIB, 10 * GIB):  # one sample a second
        rec.observe("ollama", held)
        await clock.advance(1.0)
    assert store.flush()
    loads = store.query("model_loads")
    assert len(loads) == 1, loads
    assert loads[0]["grown_bytes"] == 10 * GIB and loads[0]["duration_s"] == pytest.approx(3.0)
    assert loads[0]["gbps"] == pytest.approx(10 * GIB / 1e9 / 3.0)
    store.close()


async def test_small_vram_wobble_is_not_a_model_load(tmp_path: Path) -> None:
    clock = ManualClock()
    rec = VramRecorder(None, clock)
    for held in (GIB, GIB + 100 * MIB, GIB + 200 * MIB):
        rec.observe("ollama", held)
        await clock.advance(1.0)
    assert not rec._growth


def plan(need: int = 5 * GIB, *blockers: Blocker) -> Plan:
    return Plan("ollama", need, 0, 0, False, True, (), blockers, "test", False)


def test_each_event_of_a_handoff_adds_its_rows_once_under_the_decisions_id() -> None:
    log = DecisionLog(ManualClock())
    rows: list[tuple[str, dict[str, object]]] = []
    log.subscribe(lambda e: rows.extend(decision_rows(e, log.view_of(e))))
    started = log.emit(HandoffStarted(kind="oom_retry", tenant="ollama", trigger="OOM answer to request POST /api/generate",
                                      plan=plan()))
    assert rows == [], "a handoff that has not run yet has no row"
    release = ReleaseResult("comfyui", 6 * GIB, 6 * GIB, 0.4, True)
    log.emit(HandoffFinished(kind="oom_retry", tenant="ollama", trigger=started.trigger, refers_to=started.id,
                             releases=(release,)))
    log.emit(OomRetry(tenant="ollama", trigger="OOM answer", result="succeeded", handoff_id=started.id))
    kinds = [k for k, _ in rows]
    assert sorted(kinds) == ["decisions", "oom_retries", "releases"], kinds
    assert {r["decision_id"] for _, r in rows} == {started.id}, "every row names the decision, not its later events"
    rel = next(r for k, r in rows if k == "releases")
    assert (rel["tenant"], rel["requester"], rel["freed_bytes"], rel["duration_s"]) == ("comfyui", "ollama", 6 * GIB, 0.4)
    decision = next(r for k, r in rows if k == "decisions")
    assert decision["kind"] == "oom_retry" and decision["ok"] is True and '"releases"' in str(decision["outcome"])


def test_only_request_rejections_count_as_507s() -> None:
    log = DecisionLog(ManualClock())
    refused = plan(15 * GIB, Blocker(4242, "stt_relay.py", "unmanaged", 6 * GIB, "unmanaged", "not a tenant"))

    def rows(trigger: str, status: Literal[503, 507] = 507) -> Sequence[tuple[str, dict[str, object]]]:
        event = log.emit(Rejected(tenant="ollama", trigger=trigger, plan=refused, status=status, reason="no room"))
        return decision_rows(event, log.view_of(event))

    request = rows(RequestTrigger.of("POST", "/api/generate"))
    assert [k for k, _ in request] == ["decisions", "rejections"]
    assert request[1][1]["need_bytes"] == 15 * GIB and '"pid": 4242' in str(request[1][1]["blockers"])
    assert [k for k, _ in rows("OOM answer to request POST /api/generate")] == ["decisions"]
    assert [k for k, _ in rows(RequestTrigger.of("POST", "/api/generate"), 503)] == ["decisions"], \
        "a 503 is a wait that ran out"
    assert [k for k, _ in rows("request POST /api/generate")] == ["decisions"], "a request is known by its type, not its text"


def test_path_comes_from_the_env_var_and_off_disables() -> None:
    assert default_path({ENV: "off"}) is None
    assert default_path({ENV: ""}) is None
    assert default_path({ENV: "/data/t.db"}) == Path("/data/t.db")
    assert default_path({"HOME": "/home/u"}) == Path("/home/u/.local/state/hyperswap/telemetry.sqlite3")
    assert default_path({"HOME": "/home/u", "XDG_STATE_HOME": "/s"}) == Path("/s/hyperswap/telemetry.sqlite3")


ENV = "HYPERSWAP_TELEMETRY"


# -- ids unique across restarts; a past loss reported as past ---------------------------------------

def proxy_with_telemetry(path: Path, clock: ManualClock | None = None) -> Proxy:
    from proxy.admin.telemetry import telemetry_extension
    from proxy.engines.loading import registry_from_dict
    from proxy.service import Proxy
    from proxy.sim.gpu import SimulatedGpu

    return Proxy(registry_from_dict({"telemetry": {"path": str(path)}}), SimulatedGpu(), clock or ManualClock(),
                 watchdog_enabled=False, extension_factories=[telemetry_extension])


async def test_decision_ids_continue_after_the_stores_last_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite3"
    ids: list[int] = []
    for _run in range(2):
        proxy = proxy_with_telemetry(path)
        (tel,) = proxy.extensions
        await tel.start()
        for _ in range(3):
            d = proxy.decisions.emit(HandoffStarted(kind="release", tenant="comfyui", trigger="admin"))
            proxy.decisions.emit(HandoffFinished(kind="release", tenant="comfyui", trigger="admin", refers_to=d.id,
                                                 releases=()))
            ids.append(d.id)
        await tel.stop()
    assert len(set(ids)) == 6, f"a restart reused decision ids: {ids}"
    rows: list[dict[str, Any]] = TelemetryStore(path).query("decisions")
    stored = [r["decision_id"] for r in rows]
    assert sorted(stored) == sorted(ids) and len(set(stored)) == 6, stored


def test_decision_log_continues_after_an_id_and_never_goes_back() -> None:
    log = DecisionLog(ManualClock())
    log.continue_after(41)
    assert log.emit(StaleJob(tenant="comfyui", trigger="x", job_id="a", reason="gone")).id == 42
    log.continue_after(7)
    assert log.emit(StaleJob(tenant="comfyui", trigger="x", job_id="b", reason="gone")).id == 43


def _when(at: float) -> str:
    from datetime import datetime
    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="seconds")


async def test_after_a_disk_full_episode_health_reports_it_as_past_with_when(tmp_path: Path) -> None:
    clock = ManualClock()
    path = tmp_path / "t.sqlite3"
    proxy = proxy_with_telemetry(path, clock)
    (tel,) = [e for e in proxy.extensions if isinstance(e, Telemetry)]
    await tel.start()
    store = tel.store
    assert store is not None
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE oom_retries RENAME TO full_disk")  # every write to it fails, like a full disk
    conn.commit()
    failed_at = clock.wall()
    store.submit("oom_retries", oom_row(1))
    assert store.flush()
    ok, text = tel.healthy()
    assert not ok and "failing" in text, text

    await clock.advance(90.0)
    conn.execute("ALTER TABLE full_disk RENAME TO oom_retries")  # space again
    conn.commit()
    conn.close()
    store.submit("oom_retries", oom_row(2))
    assert store.flush()
    ok, text = tel.healthy()
    assert ok, f"writes succeed again, yet health says: {text}"
    assert "overflowed" not in text and "failing" not in text, text
    assert "1 row" in text and _when(failed_at) in text and _when(clock.wall()) in text, text
    await tel.stop()


async def test_a_queue_overflow_is_current_until_the_writer_catches_up_then_past(tmp_path: Path) -> None:
    clock = ManualClock()
    store = TelemetryStore(tmp_path / "t.sqlite3", queue_max=2, wall=clock)  # not opened: nothing drains yet
    for i in range(3):
        store.submit("oom_retries", oom_row(i))
    ok, text = store.health()
    assert not ok and "queue" in text and _when(clock.wall()) in text, text
    await clock.advance(5.0)
    store.open()
    assert store.flush()
    ok, text = store.health()
    assert ok and "1 row" in text and "queue" in text, text
    store.close()


def test_a_model_load_is_stored_as_a_load_speed_row_in_the_history(tmp_path: Path) -> None:
    from proxy.models.loads import LoadRecord
    record = LoadRecord(1000.0, "ollama", "gemma3:27b", 17 * 10**9, 8.5, 0.0, "ollama load_duration", "cold")
    log = DecisionLog(ManualClock())
    d = log.emit(ModelLoad(tenant="ollama", trigger="gemma3:27b loaded", load=record))
    rows = decision_rows(d, log.view_of(d))
    assert [k for k, _ in rows] == ["load_speeds"], "an observation, not a decision row"
    store = TelemetryStore(tmp_path / "t.sqlite3")
    store.open()
    store.submit("load_speeds", rows[0][1])
    store.close()
    store = TelemetryStore(tmp_path / "t.sqlite3")
    store.open()
    (row,) = store.query("load_speeds")
    store.close()
    assert (row["model"], row["gbps"], row["class"], row["resident_before_percent"]) == ("gemma3:27b", 2.0, "cold", 0.0)
