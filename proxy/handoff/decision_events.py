"""The decision events (proxy/handoff/decisions.py tells who emits each and how the log keeps them):
immutable facts, each emitted once, when it is known; each says what it adds to its decision's
outcome (`facts()`, as JSON) and, an opening, the plan it carries out or answers with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

from proxy.decision_base import FollowUp, Opening, RequestTrigger
from proxy.encoding import JSONObject, read_json
from proxy.handoff.plan import Plan
from proxy.handoff.plan_json import Plan as PlanJSON
from proxy.handoff.release_result import ReleaseOutcome, ReleaseResult
from proxy.models.loads import LoadRecord, MeasuredLoad

# The decisions that release: a request's plan, its OOM retry, the watchdog's spill relief and idle
# release, the admin API's release.
HandoffKind = Literal["plan", "oom_retry", "spill", "idle_release", "release"]
QueueEnd = Literal["admitted", "refused (507)", "timed out (503)", "client left while waiting"]


# -- the handoff queue ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Queued(Opening):
    """A request that needs memory first has to wait (for busy tenants, or behind another waiter)."""

    name = "queued"
    kind: Literal["queued"] = "queued"
    plan: Plan
    reason: str
    behind: int | None = None  # the waiting request it queues behind
    waiting_for: tuple[str, ...] = ()  # the tenants it waits for (`Verdict.waiting_for`); the plan's when empty

    def plan_json(self) -> JSONObject | None:
        return PlanJSON.of(self.plan).dump()

    def facts(self) -> JSONObject:
        return {"reason": self.reason, "waiting_for": list(self.waiting_for or self.plan.wait_for), "behind": self.behind}


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitChanged(FollowUp):
    """What a queued request waits for changed (another tenant, another waiter ahead of it)."""

    name = "wait_changed"
    reason: str
    waiting_for: tuple[str, ...]
    behind: int | None = None

    def facts(self) -> JSONObject:
        return {"reason": self.reason, "waiting_for": list(self.waiting_for), "behind": self.behind}


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueEnded(FollowUp):
    """A wait is over: how, after how long, and (admitted or refused) the decision that ended it."""

    name = "queue_ended"
    result: QueueEnd
    waited_s: float
    ended_by: int | None = None  # the handoff that made room, or the 507
    ended_with: str | None = None  # the scheduler's reason; None: the client left

    def facts(self) -> JSONObject:
        out: JSONObject = {"result": self.result, "waited_s": round(self.waited_s, 3)}
        if self.ended_with is not None:
            out.update(ended_by=self.ended_by, ended_with=self.ended_with)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected(Opening):
    """A request refused: 507 (not even once every busy tenant finished) or 503 (the queue timed out)."""

    name = "rejected"
    kind: Literal["rejection"] = "rejection"
    plan: Plan
    status: Literal[503, 507]
    reason: str

    @property
    def answered_request(self) -> bool:
        """A client's request got this answer (an OOM retry refused answers the engine's own error instead)."""
        return isinstance(self.trigger, RequestTrigger)

    def plan_json(self) -> JSONObject | None:
        return PlanJSON.of(self.plan).dump()

    def facts(self) -> JSONObject:
        return {"status": self.status, "reason": self.reason}


# -- releases -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class HandoffStarted(Opening):
    """A release about to run, logged before anything is asked (invariant 2): `tenant` is whose load
    the memory is for, or the tenant released when no load is behind it."""

    name = "handoff_started"
    kind: HandoffKind
    plan: Plan | None = None
    held_bytes: int | None = None  # a whole-tenant release: what it held when asked
    held_by_device: Mapping[int, int] = field(default_factory=dict)  # the same per card, on a host with several
    idle_s: float | None = None  # an idle release: the tenant's idle_release_after_s
    not_released_busy: tuple[str, ...] = ()  # tenants of the plan that had work again when its turn came

    def plan_json(self) -> JSONObject | None:
        return PlanJSON.of(self.plan).dump() if self.plan is not None else None

    def facts(self) -> JSONObject:
        out: JSONObject = {}
        if self.held_bytes is not None:
            out["held_bytes"] = self.held_bytes
        if self.held_by_device:
            out["held_by_device"] = {str(i): n for i, n in self.held_by_device.items()}
        if self.idle_s is not None:
            out["idle_s"] = self.idle_s
        if self.not_released_busy:
            out["not_released_busy"] = list(self.not_released_busy)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class HandoffFinished(FollowUp):
    """How each release of a handoff went (confirmed on the card, estimated, timed out, refused)."""

    name = "handoff_finished"
    kind: HandoffKind  # the started handoff's kind
    releases: tuple[ReleaseResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.confirmed for r in self.releases)

    def facts(self) -> JSONObject:
        return {"releases": [ReleaseOutcome.of(r).dump() for r in self.releases], "ok": self.ok}


@dataclass(frozen=True, slots=True, kw_only=True)
class NothingToRelease(Opening):
    """A release asked of a tenant that holds nothing on the card (a CPU engine): nothing was asked."""

    name = "nothing_to_release"
    kind: Literal["release"] = "release"
    reason: str

    def facts(self) -> JSONObject:
        return {"held_bytes": 0, "result": self.reason, "ok": True}


@dataclass(frozen=True, slots=True, kw_only=True)
class SpillNoPlan(Opening):
    """The watchdog saw a tenant spill to the CPU and no plan could relieve it (logged once per placement)."""

    name = "spill_no_plan"
    kind: Literal["spill"] = "spill"
    plan: Plan

    def plan_json(self) -> JSONObject | None:
        return PlanJSON.of(self.plan).dump()

    def facts(self) -> JSONObject:
        return {"ok": False, "result": "no plan: logged once for this placement"}


# -- the GPU gate ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class OomRetry(Opening):
    """How the retry after an out-of-memory failure went: "succeeded", "failed", "no plan" (the
    queue refused it), "requeued" (a ComfyUI prompt queued again under its own id; a second event,
    "succeeded" or "failed", follows when it ends and joins the same decision), "re-queue refused:
    <status>", "re-queue failed: <error>", "not retried: ...". When the retry got a decision from the
    queue (a handoff that released memory for it, or a 507), it is a fact of that decision
    (`handoff_id`) and shows in its entry as `oom_retry`; else an entry of its own, with `result`."""

    name = "oom_retry"
    kind: Literal["oom_retry"] = "oom_retry"
    result: str
    handoff_id: int | None = None  # the retry's HandoffStarted (or Rejected)
    prompt_id: str | None = None  # a ComfyUI prompt: the one that ran out of memory
    requeued_as: str | None = None  # ... and the prompt id it was queued again as (its own, where ComfyUI takes it)

    def target(self) -> int | None:
        return self.handoff_id

    def facts(self) -> JSONObject:
        out: JSONObject = {"oom_retry" if self.handoff_id is not None else "result": self.result}
        if self.requeued_as is not None:
            out["requeued_as"] = self.requeued_as
        if self.prompt_id is not None:
            out["prompt_id"] = self.prompt_id
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StaleJob(Opening):
    """A job counted as running is in neither the engine's queue nor its history: no longer counted."""

    name = "stale_job"
    kind: Literal["stale_job"] = "stale_job"
    job_id: str
    reason: str

    def facts(self) -> JSONObject:
        return {"job_id": self.job_id, "reason": self.reason}


# -- observations and the lifecycle -----------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLoad(Opening):
    """A load the engine timed itself (proxy/models/loads.py), kept for the history of load speeds."""

    name = "model_load"
    kind: Literal["model_load"] = "model_load"
    load: LoadRecord
    request: int | None = None  # the decision of the request whose load it was (its wait, or its handoff)

    def facts(self) -> JSONObject:
        out = cast(JSONObject, MeasuredLoad.of(self.load).model_dump(mode="json", exclude={"tenant"}))
        if self.request is not None:
            out["request"] = self.request
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstByte(FollowUp):
    """The engine's answer began for a request that waited or caused a handoff: when the request
    arrived and how long until the answer's first byte (a fact of its wait, or of its handoff)."""

    name = "first_byte"
    arrived_at: float  # unix seconds
    after_s: float
    status: int

    def facts(self) -> JSONObject:
        return {"arrived_at": round(self.arrived_at, 3), "first_byte_s": round(self.after_s, 3),
                "first_byte_status": self.status}


LifecycleResult = Literal["ok", "failed", "refused"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _LifecycleEvent(Opening):
    """How a start or stop of a lifecycle tenant ended, with how long it took."""

    result: LifecycleResult
    duration_s: float
    state: str  # the tenant's lifecycle state after it
    error: str | None = None
    fix: str | None = None
    output: tuple[str, ...] = ()  # the app's last output lines (a failed start, a stop that failed)
    retry_in_s: float | None = None  # a failed start: when the next may begin

    def facts(self) -> JSONObject:
        out: JSONObject = {"result": self.result, "ok": self.result == "ok", "state": self.state,
                               "duration_s": round(self.duration_s, 3)}
        if self.error is not None:
            out.update(error=self.error, fix=self.fix, output=list(self.output[-10:]), retry_in_s=self.retry_in_s)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LifecycleStart(_LifecycleEvent):
    """A lifecycle tenant was started (emitted when its readiness answered, or the start failed)."""

    name = "lifecycle_start"
    kind: Literal["start"] = "start"


@dataclass(frozen=True, slots=True, kw_only=True)
class LifecycleStop(_LifecycleEvent):
    """A lifecycle tenant was stopped (idle only: invariant 7), once it is down or the stop failed."""

    name = "lifecycle_stop"
    kind: Literal["stop"] = "stop"


@dataclass(frozen=True, slots=True, kw_only=True)
class LifecycleExit(_LifecycleEvent):
    """A lifecycle tenant ended on its own while running (its child exited or was killed, or it stopped
    answering its probe), noticed when it happened; `duration_s` is how long it ran."""

    name = "lifecycle_exit"
    kind: Literal["exit"] = "exit"
    exit_code: int | None = None  # negative: the signal that killed it
    restart_in_s: float | None = None  # the restart policy starts it again in this long; None: a request will

    def facts(self) -> JSONObject:
        return {**_LifecycleEvent.facts(self), "exit_code": self.exit_code, "restart_in_s": self.restart_in_s}


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed(Opening):
    """A tenant released by a soft step with a `resume` call was woken before its next request."""

    name = "resumed"
    kind: Literal["resume"] = "resume"
    ok: bool
    duration_s: float
    asked: Mapping[str, object] | None = None  # what the app was asked and answered (JSON)
    error: str | None = None

    def facts(self) -> JSONObject:
        asked = None if self.asked is None else read_json(self.asked)
        return {"ok": self.ok, "duration_s": round(self.duration_s, 3), "asked": asked, "error": self.error}
