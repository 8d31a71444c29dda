"""Typed views: outcomes say how they ended in a field, so nobody parses error sentences."""

from __future__ import annotations

from proxy.admin.telemetry_rows import decision_rows
from proxy.clock import ManualClock
from proxy.handoff.decisions import DecisionLog, HandoffFinished, HandoffStarted, ReleaseResult
from proxy.handoff.release_result import ReleaseOutcome


def test_a_release_says_how_it_ended_in_a_field_not_in_its_error_sentence() -> None:
    timeout = ReleaseResult("comfyui", 10, 0, 30.0, False, "the card still shows 9.5 GiB", timed_out=True)
    refused = ReleaseResult("comfyui", 10, 0, 0.1, False, "memory not back: ComfyUI refused /free")
    estimated = ReleaseResult("ollama", 10, 10, 0.5, False, estimated=True)
    confirmed = ReleaseResult("ollama", 10, 10, 0.5, True)
    assert [r.result for r in (timeout, refused, estimated, confirmed)] == ["timeout", "error", "estimated", "confirmed"]
    for r in (timeout, refused, estimated, confirmed):
        assert ReleaseOutcome.of(r).dump()["result"] == r.result
        assert ReleaseOutcome.model_validate(ReleaseOutcome.of(r).dump()).result == r.result, \
            "the API's schema reads what was recorded"


def test_telemetry_rows_come_from_the_typed_events() -> None:
    log = DecisionLog(ManualClock())
    rows: list[tuple[str, dict[str, object]]] = []
    log.subscribe(lambda e: rows.extend(decision_rows(e, log.view_of(e))))
    d = log.emit(HandoffStarted(kind="idle_release", tenant="comfyui", trigger="watchdog idle", held_bytes=8, idle_s=60.0))
    log.emit(HandoffFinished(kind="idle_release", tenant="comfyui", trigger="watchdog idle", refers_to=d.id,
                             releases=(ReleaseResult("comfyui", 8, 0, 30.0, False, "x", timed_out=True),)))
    (release,) = [r for k, r in rows if k == "releases"]
    assert release["confirmed"] is False and release["duration_s"] == 30.0 and release["tenant"] == "comfyui"
    assert [k for k, _ in rows].count("decisions") == 1
    (decision,) = [r for k, r in rows if k == "decisions"]
    assert decision["ok"] is False and decision["decision_id"] == d.id and '"idle_s": 60.0' in str(decision["outcome"])
