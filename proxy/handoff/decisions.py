"""The decision log: every plan, release, wait, rejection and retry, as typed events.

Each decision is told by immutable events (the base is proxy/decision.py), each emitted once, when
its fact is known: a handoff is logged when it starts, before anything is asked (invariant 2), and
its results come as a second event that refers to it by id, never by changing the first. Who emits:

- `Queued` (scheduler.py): a request first has to wait; `WaitChanged` when what it waits for changes;
  `QueueEnded` (admitted, refused, timed out, client left) with how long it waited and the decision
  that ended the wait.
- `HandoffStarted` / `HandoffFinished` (arbitration.py `carry_out`, the one release path for the
  queue's plans and OOM retries, the watchdog's spill relief and idle releases, the admin API).
- `Rejected`: 507 (scheduler.py) or 503 after the queue timeout (relay/gpu_gate.py).
- `OomRetry`, `StaleJob`, `FirstByte` (relay/gpu_gate.py: a request that waited or caused a handoff
  got its answer's first byte); `SpillNoPlan` (watchdog.py); `NothingToRelease`
  (admin/api.py: a CPU engine); `ModelLoad` (admin/models_api.py); `GpuDrift`, `GpuApplyStarted`,
  `GpuApplyFinished` (gpu/keeper.py); `LifecycleStart`, `LifecycleStop` (a lifecycle tenant's start
  and stop, with how long it took and how it ended), `LifecycleExit` (it ended on its own while running).

The log numbers them, writes each as one JSON line (`{"decision": {...}}`; people grep them), keeps
a bounded ring of the decisions as people read them (`DecisionView`: an opening event with the facts
of its follow-ups merged into its `outcome`, the shape of `GET /api/decisions`), tells one request's story from them
(`request_story`: arrived, waited for whom, the releases, the load, the first byte;
`GET /api/decisions/{id}`), and hands each event
to its subscribers (metrics, telemetry, the events stream), which match on the type.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from proxy.clock import Clock
from proxy.decision_base import DecisionEvent, DecisionKind, E, FollowUp, Opening, RequestTrigger
from proxy.encoding import JSONObject, read_json
from proxy.handoff.outcome import DecisionOutcome
from proxy.handoff.plan import Plan, gib
from proxy.handoff.plan_json import Plan as PlanJSON
from proxy.handoff.queue_rules import held_swap
from proxy.handoff.release_result import ReleaseOutcome, ReleaseResult, ReleaseVerdict
from proxy.models.loads import LoadRecord

log = logging.getLogger("hyperswap.decisions")

__all__ = [
    "DecisionEvent",
    "DecisionKind",
    "DecisionLog",
    "DecisionView",
    "FirstByte",
    "FollowUp",
    "HandoffFinished",
    "HandoffKind",
    "HandoffStarted",
    "LifecycleExit",
    "LifecycleStart",
    "LifecycleStop",
    "ModelLoad",
    "NothingToRelease",
    "OomRetry",
    "Opening",
    "QueueEnd",
    "QueueEnded",
    "Queued",
    "Rejected",
    "ReleaseResult",
    "ReleaseVerdict",
    "RequestStory",
    "Resumed",
    "SpillNoPlan",
    "StaleJob",
    "StoryStep",
    "WaitChanged",
    "request_story",
]

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
        out = {k: v for k, v in self.load.to_json().items() if k != "tenant"}
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


# -- the view and the log ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DecisionView:
    """A decision as GET /api/decisions, the events stream and the dashboard show it: its opening
    event's fields, with every later fact merged into `outcome` (a new view each time: never changed)."""

    id: int
    at: float  # unix seconds, when it opened
    kind: DecisionKind
    tenant: str
    trigger: str
    plan: JSONObject | None
    outcome: JSONObject

    @classmethod
    def of(cls, event: Opening) -> DecisionView:
        return cls(event.id, event.at, event.kind, event.tenant, event.trigger, event.plan_json(), event.facts())

    def read(self) -> DecisionOutcome:
        """The outcome, typed: every key optional (a decision's outcome grows as it goes on)."""
        return DecisionOutcome.model_validate(self.outcome)

    def merged(self, event: DecisionEvent) -> DecisionView:
        return replace(self, outcome={**self.outcome, **event.facts()})



class DecisionLog:
    """The one owner of the decision events: numbers them, logs them, keeps the recent decisions."""

    def __init__(self, clock: Clock, maxlen: int = 500) -> None:
        self._clock = clock
        self._maxlen = maxlen
        self._views: OrderedDict[int, DecisionView] = OrderedDict()
        # each kept decision's events as emitted, its opening first: what a request's story is told from
        self._threads: dict[int, list[DecisionEvent]] = {}
        self._events: deque[DecisionEvent] = deque(maxlen=maxlen)
        self._last_id = 0
        self._subscribers: list[Callable[[DecisionEvent], None]] = []

    def continue_after(self, last_id: int) -> None:
        """Number the next decision after `last_id` (the telemetry store's newest), so an id names
        one decision across restarts; never goes back."""
        self._last_id = max(self._last_id, last_id)

    def emit(self, event: E) -> E:
        """Number and stamp the event, log it as one JSON line, fold it into its decision's view and
        hand it to the subscribers. Returns the event as emitted (with its id)."""
        self._last_id += 1
        event = replace(event, id=self._last_id, at=self._clock.wall())
        self._events.append(event)
        log.info(json.dumps({"decision": event.line().dump()}, default=str))
        target = event.target()
        if target is None and isinstance(event, Opening):
            self._views[event.id] = DecisionView.of(event)
            self._threads[event.id] = [event]
            while len(self._views) > self._maxlen:
                gone, _ = self._views.popitem(last=False)
                self._threads.pop(gone, None)
        elif target is not None and (view := self._views.get(target)) is not None:
            self._views[target] = view.merged(event)
            self._threads[target].append(event)
        self._notify(event)
        return event

    def recent(self, limit: int = 100) -> list[DecisionView]:
        """The newest decisions, oldest first, each with what is known of it so far."""
        return list(self._views.values())[-limit:]

    def view(self, decision_id: int) -> DecisionView | None:
        """A decision as it stands now (None: too old, no longer kept)."""
        return self._views.get(decision_id)

    def story(self, decision_id: int) -> RequestStory | None:
        """The story of the request a decision belongs to (see `request_story`)."""
        return request_story(self._threads, decision_id)

    def view_of(self, event: DecisionEvent) -> DecisionView | None:
        """The decision an event opened or is a later fact of, as it stands after it."""
        target = event.target()
        return self._views.get(event.id if target is None else target)

    def events(self, limit: int = 500) -> list[DecisionEvent]:
        """The newest events as emitted, oldest first."""
        return list(self._events)[-limit:]

    def subscribe(self, fn: Callable[[DecisionEvent], None]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def _notify(self, event: DecisionEvent) -> None:
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:  # a broken subscriber must not break a handoff
                log.exception("decision subscriber failed")


# -- one request's story ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StoryStep:
    """One bar of a request's waterfall: seconds from its arrival."""

    kind: Literal["wait", "hold", "release", "load", "first_byte"]
    text: str
    start_s: float
    duration_s: float
    decision: int  # the decision it is told from
    tenant: str | None = None  # wait: whom it waited for; release: who was released; load: the requester



@dataclass(frozen=True, slots=True)
class RequestStory:
    """Why one GPU request took as long as it did, from the decision log."""

    request: int  # the decision the story hangs on: the request's wait, else the handoff it caused
    tenant: str
    trigger: str
    arrived_at: float
    steps: tuple[StoryStep, ...]
    related: tuple[int, ...]  # the decisions it is told from
    first_byte_s: float | None  # None: no answer yet (or it was refused)



Thread = Sequence[DecisionEvent]  # one decision's events: its opening, then its follow-ups as emitted


def _last(thread: Thread, kind: type[E]) -> E | None:
    return next((e for e in reversed(thread) if isinstance(e, kind)), None)


def _requested(thread: Thread | None, kind: type[E]) -> E | None:
    """The decision's opening, if it is of this type and a client's request asked for it."""
    opening = thread[0] if thread else None
    return opening if isinstance(opening, kind) and isinstance(opening.trigger, RequestTrigger) else None


def _story_root(threads: Mapping[int, Thread], decision_id: int) -> Thread | None:
    """The decision a request's story hangs on (its wait, else its handoff), from any decision of it."""
    thread = threads.get(decision_id)
    if not thread:
        return None
    opening = thread[0]
    if isinstance(opening, ModelLoad):  # a load no wait or handoff led to (a reload, a cold start) is its own story
        return threads.get(opening.request) if opening.request is not None else thread
    if _requested(thread, Queued) is not None:
        return thread
    started = _requested(thread, HandoffStarted)
    if started is None or started.kind != "plan":
        return None
    waited = next((t for t in threads.values() if isinstance(t[0], Queued)
                   and (end := _last(t, QueueEnded)) is not None and end.ended_by == started.id), None)
    return waited or thread


def _wait_step(opening: Queued, queued: Thread, arrived: float, handoff: HandoffStarted | None) -> StoryStep:
    """The request's wait: one figure, the same as the Decisions list's (`waited_s`, arrival to
    admission: the queue and the releases it waited on). The bar covers the queue alone (the release
    has its own), so the text says the split when a release is part of the wait."""
    ended = _last(queued, QueueEnded)
    changed = _last(queued, WaitChanged)
    waiting_for = changed.waiting_for if changed is not None else opening.plan.wait_for
    held = held_swap(changed.reason if changed is not None else opening.reason)
    waited = round(ended.waited_s, 3) if ended is not None else 0.0
    end = (handoff.at - arrived) if handoff is not None else waited
    who = ", ".join(waiting_for) or None
    behind = f"behind {who}" if who else "in the queue"
    text = f"waited {waited:.1f} s {behind}" if ended is not None else f"waiting {behind}"
    if ended is not None and handoff is not None and waited - end >= 0.05:
        text += f" ({end:.1f} s queued, then the release)"
    if held is not None:  # a choice, not a wait for busy work: told apart, in its own colour
        kept = f"kept {held[0]} on the card {max(0.0, end):.1f} s: just used, requests for it go first"
        text = kept if ended is None or ended.result == "admitted" else f"{kept}, then {ended.result}"
    elif ended is not None and ended.result != "admitted":
        text += f", then {ended.result}"
    return StoryStep("hold" if held is not None else "wait", text, 0.0, max(0.0, end), opening.id, who)


def _release_steps(handoff: Thread, arrived: float) -> list[StoryStep]:
    """Each release of the handoff that made room, one after another."""
    finished = _last(handoff, HandoffFinished)
    start = handoff[0].at - arrived
    steps = []
    for r in finished.releases if finished is not None else ():
        duration = round(r.duration_s, 3)
        how = "" if r.confirmed else f" ({r.error or r.result})"
        steps.append(StoryStep("release", f"released {r.tenant} in {duration:.1f} s, {gib(r.freed_bytes)} GiB back{how}",
                               max(0.0, start), duration, handoff[0].id, r.tenant))
        start += duration
    return steps


def _load_step(load: ModelLoad, arrived: float, tenant: str) -> StoryStep:
    seconds, ended = round(load.load.seconds, 4), round(load.load.at, 3)
    return StoryStep("load", f"loaded {load.load.model} in {seconds:.1f} s", max(0.0, ended - seconds - arrived),
                     seconds, load.id, tenant)


def _handoff_of(threads: Mapping[int, Thread], root: Thread) -> tuple[HandoffStarted, Thread] | None:
    """The handoff that made room for the request: the one that ended its wait, or the root itself
    when it did not wait; None when it needed none, or its wait ended otherwise (a 507, a timeout)."""
    if isinstance(root[0], Queued):
        ended = _last(root, QueueEnded)
        thread = threads.get(ended.ended_by) if ended is not None and ended.ended_by is not None else None
    else:
        thread = root
    started = thread[0] if thread else None
    return (started, thread) if isinstance(started, HandoffStarted) and started.kind == "plan" and thread else None


def _load_story(load: ModelLoad) -> RequestStory:
    """The story of a request that only loaded its model (nothing to wait for, nothing released): the load."""
    arrived = round(load.load.at - load.load.seconds, 3)
    return RequestStory(load.id, load.tenant, f"load of {load.load.model}", arrived,
                        (_load_step(load, arrived, load.tenant),), (load.id,), None)


def request_story(threads: Mapping[int, Thread], decision_id: int) -> RequestStory | None:
    """The waterfall of the request `decision_id` belongs to (its wait, its handoff or its load), told
    from the typed events of its decisions: None when that decision is no GPU request's that waited or
    caused a handoff (or is too old)."""
    root = _story_root(threads, decision_id)
    if root is None:
        return None
    opening = root[0]
    if isinstance(opening, ModelLoad):
        return _load_story(opening)
    queued = opening if isinstance(opening, Queued) else None
    made_room = _handoff_of(threads, root)
    handoff, handoff_thread = made_room if made_room is not None else (None, None)
    load = next((t[0] for t in reversed(list(threads.values()))
                 if isinstance(t[0], ModelLoad) and t[0].request == opening.id), None)
    first = _last(root, FirstByte)
    arrived = round(first.arrived_at, 3) if first is not None else opening.at
    steps = [_wait_step(queued, root, arrived, handoff)] if queued is not None else []
    if handoff_thread is not None:
        steps += _release_steps(handoff_thread, arrived)
    if isinstance(load, ModelLoad):
        steps.append(_load_step(load, arrived, opening.tenant))
    first_s = None
    if first is not None:
        first_s = round(first.after_s, 3)  # as the decision's outcome says it
        status = f" ({first.status})" if first.status >= 400 else ""
        steps.append(StoryStep("first_byte", f"first byte after {first_s:.1f} s{status}", first_s, 0.0, opening.id, None))
    parts = (queued, handoff, load, opening)
    related = tuple(sorted(dict.fromkeys(e.id for e in parts if e is not None)))
    return RequestStory(opening.id, opening.tenant, opening.trigger, arrived, tuple(steps), related, first_s)
