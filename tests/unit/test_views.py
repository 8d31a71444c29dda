"""Typed views: outcomes say how they ended in a field, so nobody parses error sentences."""

from __future__ import annotations

from proxy.admin.metrics import release_result
from proxy.admin.telemetry import decision_rows
from proxy.admin.views import DecisionOutcome, ReleaseOutcome
from proxy.clock import ManualClock
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.queue import ReleaseResult


def test_a_release_says_how_it_ended_in_a_field_not_in_its_error_sentence() -> None:
    timeout = ReleaseResult("comfyui", 10, 0, 30.0, False, "the card still shows 9.5 GiB", timed_out=True)
    refused = ReleaseResult("comfyui", 10, 0, 0.1, False, "memory not back: ComfyUI refused /free")
    estimated = ReleaseResult("ollama", 10, 10, 0.5, False, estimated=True)
    confirmed = ReleaseResult("ollama", 10, 10, 0.5, True)
    assert [r.result for r in (timeout, refused, estimated, confirmed)] == ["timeout", "error", "estimated", "confirmed"]
    for r in (timeout, refused, estimated, confirmed):
        assert r.to_json()["result"] == r.result
        assert release_result(r.to_json()) == r.result, "metrics count what the release recorded"
        assert ReleaseOutcome.model_validate(r.to_json()).verdict == r.result


def test_an_outcome_written_before_releases_had_a_result_is_read_from_its_flags() -> None:
    old = {"tenant": "comfyui", "confirmed": False, "estimated": True, "error": None}
    assert ReleaseOutcome.model_validate(old).verdict == "estimated"
    assert ReleaseOutcome.model_validate({**old, "error": "refused"}).verdict == "error"


def test_retry_results_come_from_the_plan_or_the_oom_retry_decision() -> None:
    assert DecisionOutcome.model_validate({"oom_retry": "succeeded"}).retry_result("plan") == "succeeded"
    assert DecisionOutcome.model_validate({"result": "failed"}).retry_result("oom_retry") == "failed"
    assert DecisionOutcome.model_validate({"result": "admitted"}).retry_result("queued") is None
    assert DecisionOutcome.model_validate({"ok": True, "held_bytes": 5}).final, "unknown keys are kept, not refused"


def test_telemetry_rows_come_from_the_typed_outcome() -> None:
    log = DecisionLog(ManualClock())
    rows: list[tuple[str, dict[str, object]]] = []
    seen: set[str] = set()
    log.subscribe(lambda d: rows.extend(decision_rows(d, seen)))
    d = log.record("idle_release", "comfyui", "watchdog idle", None)
    log.update(d, releases=[ReleaseResult("comfyui", 8, 0, 30.0, False, "x", timed_out=True).to_json()], ok=False)
    (release,) = [r for k, r in rows if k == "releases"]
    assert release["confirmed"] is False and release["duration_s"] == 30.0 and release["tenant"] == "comfyui"
    assert [k for k, _ in rows].count("decisions") == 1
