"""Decision events: typed, immutable, emitted once; the log line and GET /api/decisions are renderings."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from proxy.admin import views
from proxy.clock import ManualClock
from proxy.config.units import GIB
from proxy.decision_base import DecisionEvent, RequestTrigger
from proxy.gpu.keeper import GpuApplyFinished, GpuApplyStarted, GpuDrift, WriteFailure
from proxy.gpu.profile import FieldCheck
from proxy.handoff.decision_json import Decision, RequestStory
from proxy.handoff.decisions import (
    DecisionLog,
    FirstByte,
    HandoffFinished,
    HandoffStarted,
    LifecycleStart,
    LifecycleStop,
    ModelLoad,
    NothingToRelease,
    OomRetry,
    Queued,
    QueueEnded,
    Rejected,
    ReleaseResult,
    Resumed,
    SpillNoPlan,
    StaleJob,
    WaitChanged,
)
from proxy.handoff.plan import Blocker, Plan, Release
from proxy.handoff.plan_json import plan_json
from proxy.handoff.policy import hold_reason
from proxy.handoff.release_result import ReleaseOutcome
from proxy.models.loads import LoadRecord

RELEASE = Release("comfyui", 7 * GIB, (4242,), "idle")
PLAN = Plan("ollama", 16 * GIB, 10 * GIB, 0, True, False, (RELEASE,), (), "release comfyui", False)
WAIT = Plan("ollama", 16 * GIB, 10 * GIB, 0, False, True, (), (), "wait", False, wait_for=("comfyui",))
REFUSED = Plan("ollama", 90 * GIB, 10 * GIB, 0, False, True, (),
               (Blocker(4321, "stt_relay.py", "unmanaged", 6 * GIB, "unmanaged", "not a tenant"),), "too big", False,
               possible=False)


REQUEST = RequestTrigger.of("POST", "/api/generate")  # what the GPU gate gives a request's decisions

def test_a_handoff_is_logged_before_it_runs_and_its_results_are_a_second_event_merged_into_its_view() -> None:
    log = DecisionLog(ManualClock())
    started = log.emit(HandoffStarted(kind="plan", tenant="ollama", trigger="request POST /api/generate", plan=PLAN))
    (before,) = log.recent()
    assert before.outcome == {} and before.plan == plan_json(PLAN), "logged with its plan, before anything is asked"
    result = ReleaseResult("comfyui", 7 * GIB, 7 * GIB, 0.4, True)
    finished = log.emit(HandoffFinished(kind="plan", tenant="ollama", trigger=started.trigger, refers_to=started.id,
                                        releases=(result,)))
    (after,) = log.recent()
    assert finished.id > started.id and finished.refers_to == started.id
    assert after.id == started.id and after.kind == "plan"
    assert after.outcome == {"releases": [ReleaseOutcome.of(result).dump()], "ok": True}
    assert before.outcome == {}, "a view is never changed: a later fact makes a new one"
    assert log.events() == [started, finished]


def test_events_are_immutable() -> None:
    event = StaleJob(tenant="comfyui", trigger="job reconciliation", job_id="p1", reason="gone")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.reason = "changed"  # type: ignore[misc]


def test_each_event_is_one_json_log_line_that_says_which_event_and_which_decision(
        caplog: pytest.LogCaptureFixture) -> None:
    log = DecisionLog(ManualClock())
    with caplog.at_level(logging.INFO, logger="hyperswap.decisions"):
        queued = log.emit(Queued(tenant="ollama", trigger="request POST /api/chat", plan=WAIT, reason="queued behind comfyui"))
        log.emit(QueueEnded(tenant="ollama", trigger=queued.trigger, refers_to=queued.id, result="client left while waiting",
                            waited_s=1.23456))
    lines = [json.loads(r.getMessage())["decision"] for r in caplog.records]
    assert [line["event"] for line in lines] == ["queued", "queue_ended"]
    assert lines[0]["kind"] == "queued" and lines[0]["plan"]["wait_for"] == ["comfyui"] and "refers_to" not in lines[0]
    assert lines[1]["refers_to"] == queued.id and lines[1]["outcome"] == {"result": "client left while waiting",
                                                                          "waited_s": 1.235}


def test_a_wait_shows_what_it_waits_for_now_and_how_it_ended_in_one_entry() -> None:
    log = DecisionLog(ManualClock())
    queued = log.emit(Queued(tenant="ollama", trigger="request", plan=WAIT, reason="queued behind comfyui", behind=None))
    log.emit(WaitChanged(tenant="ollama", trigger="request", refers_to=queued.id, reason="queued behind waiter 3",
                         waiting_for=(), behind=3))
    rejected = log.emit(Rejected(tenant="ollama", trigger="request", plan=REFUSED, status=507, reason="too big"))
    log.emit(QueueEnded(tenant="ollama", trigger="request", refers_to=queued.id, result="refused (507)", waited_s=2.0,
                        ended_by=rejected.id, ended_with="too big"))
    view = log.view(queued.id)
    assert view is not None and [d.id for d in log.recent()] == [queued.id, rejected.id]
    assert view.outcome == {"reason": "queued behind waiter 3", "waiting_for": [], "behind": 3, "result": "refused (507)",
                            "waited_s": 2.0, "ended_by": rejected.id, "ended_with": "too big"}


def test_an_oom_retry_is_a_fact_of_the_handoff_it_got_or_an_entry_of_its_own() -> None:
    log = DecisionLog(ManualClock())
    started = log.emit(HandoffStarted(kind="oom_retry", tenant="comfyui", trigger="OOM of ComfyUI prompt p1", plan=PLAN))
    log.emit(OomRetry(tenant="comfyui", trigger="OOM answer", result="requeued", handoff_id=started.id, prompt_id="p1",
                      requeued_as="p2"))
    alone = log.emit(OomRetry(tenant="ollama", trigger="OOM answer", result="no plan"))
    merged, own = log.recent()
    assert merged.id == started.id and merged.outcome == {"oom_retry": "requeued", "requeued_as": "p2", "prompt_id": "p1"}
    assert own.id == alone.id and own.kind == "oom_retry" and own.outcome == {"result": "no plan"}


def test_a_later_fact_of_a_decision_no_longer_kept_changes_no_other_entry() -> None:
    log = DecisionLog(ManualClock(), maxlen=2)
    first = log.emit(Queued(tenant="ollama", trigger="request", plan=WAIT, reason="r"))
    for job in ("a", "b"):
        log.emit(StaleJob(tenant="comfyui", trigger="job reconciliation", job_id=job, reason="gone"))
    late = log.emit(QueueEnded(tenant="ollama", trigger="request", refers_to=first.id, result="admitted", waited_s=1.0))
    assert log.view(first.id) is None and log.view_of(late) is None
    assert [d.outcome["job_id"] for d in log.recent()] == ["a", "b"]


def every_kind(log: DecisionLog) -> list[DecisionEvent]:
    """One of each event, as their emitters make them."""
    load = LoadRecord(1000.0, "ollama", "gemma3:27b", 17 * 10**9, 8.5, 0.5, "ollama load_duration", "warm")
    drift = FieldCheck("power_limit_w", "drift", 300, 250, "250 W, profile says 300 W")
    started = log.emit(HandoffStarted(kind="idle_release", tenant="comfyui", trigger="watchdog idle", held_bytes=7 * GIB,
                                      held_by_device={0: 7 * GIB}, idle_s=600.0, not_released_busy=("stt",)))
    queued = log.emit(Queued(tenant="ollama", trigger="request", plan=WAIT, reason="queued behind comfyui"))
    apply = log.emit(GpuApplyStarted(tenant="", trigger="gpu_profile.apply (first check)", device=0,
                                     changes=("power_limit_w = 300",)))
    return [
        started,
        log.emit(HandoffFinished(kind="idle_release", tenant="comfyui", trigger="watchdog idle", refers_to=started.id,
                                 releases=(ReleaseResult("comfyui", 7 * GIB, 0, 30.0, False, "late", timed_out=True),))),
        queued,
        log.emit(WaitChanged(tenant="ollama", trigger="request", refers_to=queued.id, reason="r", waiting_for=("stt",))),
        log.emit(QueueEnded(tenant="ollama", trigger="request", refers_to=queued.id, result="timed out (503)", waited_s=30.0,
                            ended_with="queued behind comfyui")),
        log.emit(Rejected(tenant="ollama", trigger="request POST /api/generate", plan=WAIT, status=503, reason="timeout")),
        log.emit(Rejected(tenant="ollama", trigger="request POST /api/generate", plan=REFUSED, status=507, reason="big")),
        log.emit(NothingToRelease(tenant="comfyui", trigger="admin", reason="runs on the CPU")),
        log.emit(SpillNoPlan(tenant="ollama", trigger="watchdog: gemma spilling to the CPU", plan=REFUSED)),
        log.emit(OomRetry(tenant="ollama", trigger="OOM answer", result="failed")),
        log.emit(StaleJob(tenant="comfyui", trigger="job reconciliation", job_id="p9", reason="gone")),
        log.emit(ModelLoad(tenant="ollama", trigger="gemma3:27b loaded", load=load)),
        log.emit(GpuDrift(tenant="", trigger="gpu settings check", device=0, drifting=(drift,), started=("power_limit_w",),
                          resolved=())),
        apply,
        log.emit(GpuApplyFinished(tenant="", trigger=apply.trigger, refers_to=apply.id, ok=False,
                                  errors=(WriteFailure(kind="no_permission", error="no root", fix="run as root"),),
                                  still_drifting=("power_limit_w",), next_attempt_in_s=30.0)),
        log.emit(LifecycleStart(tenant="comfyui", trigger="request POST /prompt", result="ok", duration_s=12.5,
                                state="running")),
        log.emit(LifecycleStop(tenant="comfyui", trigger="watchdog idle", result="failed", duration_s=30.0,
                               state="running", error="still running after SIGTERM", output=("shutting down",))),
        log.emit(Resumed(tenant="vllm", trigger="request to a released tenant", ok=True, duration_s=4.2,
                         asked={"POST /wake_up": 200})),
    ]


def test_every_decision_renders_in_the_shape_the_api_schema_and_the_dashboard_read() -> None:
    log = DecisionLog(ManualClock())
    events = every_kind(log)
    assert len({type(e) for e in events}) == 17 and len({e.id for e in events}) == len(events)
    for view in log.recent():
        checked = views.Decision.model_validate(Decision.of(view).dump())  # what /openapi.json says GET /api/decisions answers
        assert checked.id == view.id and checked.kind == view.kind
    kinds = {d.kind for d in log.recent()}
    assert kinds == {"idle_release", "queued", "rejection", "release", "spill", "oom_retry", "stale_job", "model_load",
                     "gpu_drift", "gpu_apply", "start", "stop", "resume"}
    by_kind = {d.kind: d for d in log.recent()}
    assert by_kind["idle_release"].outcome["held_by_device"] == {"0": 7 * GIB}
    assert by_kind["gpu_apply"].outcome["ok"] is False and by_kind["gpu_apply"].outcome["changes"] == ["power_limit_w = 300"]
    assert by_kind["model_load"].outcome["class"] == "warm" and "tenant" not in by_kind["model_load"].outcome
    for event in events:
        json.dumps(event.line().dump())  # every log line is JSON as it is, without a fallback


async def test_a_requests_story_tells_its_wait_the_release_the_load_and_the_first_byte_from_any_of_its_decisions() -> None:
    clock = ManualClock()
    log = DecisionLog(clock)
    arrived = clock.wall()
    queued = log.emit(Queued(tenant="ollama", trigger=REQUEST, plan=WAIT,
                             reason="queued behind comfyui (1 running job(s))"))
    await clock.advance(4.0)  # the render ends
    started = log.emit(HandoffStarted(tenant="ollama", trigger=REQUEST, kind="plan", plan=PLAN))
    await clock.advance(0.5)
    freed = ReleaseResult("comfyui", 7 * GIB, 7 * GIB, 0.5, True)
    log.emit(HandoffFinished(tenant="ollama", trigger=REQUEST, refers_to=started.id, kind="plan",
                             releases=(freed,)))
    log.emit(QueueEnded(tenant="ollama", trigger=REQUEST, refers_to=queued.id, result="admitted",
                        waited_s=4.5, ended_by=started.id, ended_with="release comfyui"))
    await clock.advance(8.0)
    load = log.emit(ModelLoad(tenant="ollama", trigger="gemma3:27b loaded", request=queued.id,
                              load=LoadRecord(clock.wall(), "ollama", "gemma3:27b", 16 * GIB, 8.0, 1.0, "ollama")))
    log.emit(FirstByte(tenant="ollama", trigger=REQUEST, refers_to=queued.id, arrived_at=arrived,
                       after_s=12.6, status=200))

    story = log.story(started.id)
    assert story is not None and story == log.story(queued.id) == log.story(load.id), "any of its decisions tells it"
    assert story.request == queued.id and story.related == (queued.id, started.id, load.id)
    assert [(s.kind, s.text) for s in story.steps] == [
        ("wait", "waited 4.5 s behind comfyui (4.0 s queued, then the release)"),
        ("release", "released comfyui in 0.5 s, 7.0 GiB back"),
        ("load", "loaded gemma3:27b in 8.0 s"), ("first_byte", "first byte after 12.6 s")]
    assert [s.start_s for s in story.steps] == [0.0, 4.0, 4.5, 12.6] and story.first_byte_s == 12.6
    json_story = views.RequestStory.model_validate(RequestStory.of(story).dump())
    assert json_story.steps[1].tenant == "comfyui"
    assert log.story(log.emit(StaleJob(tenant="comfyui", trigger="poll", job_id="x", reason="gone")).id) is None, \
        "a decision of no request has no story"


def test_the_demo_prints_a_wait_and_a_refusal_as_one_readable_line_each() -> None:
    from proxy.demo import decision_line
    from proxy.handoff.decisions import DecisionView

    waited = DecisionView(7, 0.0, "queued", "ollama", "request POST /api/chat", None,
                          {"reason": "x", "waiting_for": ["comfyui"], "behind": None, "result": "admitted", "waited_s": 1.25})
    assert decision_line(waited) == "#7 queued       ollama waited 1.2 s for comfyui: admitted  (request POST /api/chat)"
    refused = DecisionView(8, 0.0, "rejection", "ollama", "request POST /api/generate", None,
                           {"status": 507, "reason": "ollama needs 30 GiB, 24 GiB on the card"})
    assert decision_line(refused).startswith("#8 rejection    ollama refused 507: ollama needs 30 GiB"), decision_line(refused)


async def test_a_wait_refused_at_its_end_is_told_without_a_release_and_only_a_request_has_a_story() -> None:
    clock = ManualClock()
    log = DecisionLog(clock)
    queued = log.emit(Queued(tenant="ollama", trigger=REQUEST, plan=WAIT, reason="queued behind comfyui"))
    log.emit(WaitChanged(tenant="ollama", trigger=REQUEST, refers_to=queued.id, reason="r", waiting_for=("stt",)))
    story = log.story(queued.id)
    assert story is not None and [s.text for s in story.steps] == ["waiting behind stt"], "a wait under way"
    await clock.advance(2.0)
    refused = log.emit(Rejected(tenant="ollama", trigger=REQUEST, plan=REFUSED, status=507, reason="too big"))
    log.emit(QueueEnded(tenant="ollama", trigger=REQUEST, refers_to=queued.id, result="refused (507)", waited_s=2.0,
                        ended_by=refused.id, ended_with="too big"))
    story = log.story(queued.id)
    assert story is not None and [(s.kind, s.text) for s in story.steps] == [
        ("wait", "waited 2.0 s behind stt, then refused (507)")], "the 507 that ended it is no handoff"
    assert story.related == (queued.id,) and story.first_byte_s is None
    plain = log.emit(Queued(tenant="ollama", trigger="request POST /api/generate", plan=WAIT, reason="r"))
    assert log.story(plain.id) is None, "a request is known by its trigger's type, not by its text"


async def test_a_held_swap_is_a_hold_step_and_a_load_nothing_led_to_is_a_story_of_its_own() -> None:
    clock = ManualClock()
    log = DecisionLog(clock)
    queued = log.emit(Queued(tenant="comfyui", trigger=REQUEST, plan=PLAN, reason=hold_reason(("ollama",), 1.0),
                             waiting_for=("ollama",)))
    await clock.advance(1.0)
    started = log.emit(HandoffStarted(tenant="comfyui", trigger=REQUEST, kind="plan", plan=PLAN))
    log.emit(QueueEnded(tenant="comfyui", trigger=REQUEST, refers_to=queued.id, result="admitted", waited_s=1.0,
                        ended_by=started.id, ended_with="release ollama"))
    story = log.story(queued.id)
    assert story is not None
    assert (story.steps[0].kind, story.steps[0].text) == (
        "hold", "kept ollama on the card 1.0 s: just used, requests for it go first"), story.steps

    reload = log.emit(ModelLoad(tenant="ollama", trigger="gemma3:27b loaded", request=None,
                                load=LoadRecord(clock.wall(), "ollama", "gemma3:27b", 16 * GIB, 8.0, 1.0, "ollama")))
    alone = log.story(reload.id)
    assert alone is not None and alone.request == reload.id and alone.trigger == "load of gemma3:27b"
    assert [(s.kind, s.start_s, s.duration_s) for s in alone.steps] == [("load", 0.0, 8.0)], alone.steps
    assert views.RequestStory.model_validate(RequestStory.of(alone).dump()).steps[0].kind == "load"
