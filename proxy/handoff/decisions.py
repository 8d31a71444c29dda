"""The decision log: every plan, release, wait, rejection and retry, as typed events.

Each decision is told by immutable events (the base is proxy/decision_base.py, the events
proxy/handoff/decision_events.py, re-exported here), each emitted once, when
its fact is known: a handoff is logged when it starts, before anything is asked (invariant 2), and
its results come as a second event that refers to it by id, never by changing the first. Who emits:

- `Queued` (scheduler.py): a request first has to wait; `WaitChanged` when what it waits for changes;
  `QueueEnded` (admitted, refused, timed out, client left) with how long it waited and the decision
  that ended the wait.
- `HandoffStarted` / `HandoffFinished` (broker.py `carry_out`, the one release path for the
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
(`request_story`, proxy/handoff/story.py: arrived, waited for whom, the releases, the load, the first byte;
`GET /api/decisions/{id}`), and hands each event
to its subscribers (metrics, telemetry, the events stream), which match on the type.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from proxy.clock import Clock
from proxy.decision_base import DecisionEvent, DecisionKind, E, FollowUp, Opening
from proxy.encoding import JSONObject
from proxy.handoff.decision_events import (
    FirstByte,
    HandoffFinished,
    HandoffKind,
    HandoffStarted,
    LifecycleExit,
    LifecycleResult,
    LifecycleStart,
    LifecycleStop,
    ModelLoad,
    NothingToRelease,
    OomRetry,
    Queued,
    QueueEnd,
    QueueEnded,
    Rejected,
    Resumed,
    SpillNoPlan,
    StaleJob,
    WaitChanged,
)
from proxy.handoff.outcome import DecisionOutcome
from proxy.handoff.release_result import ReleaseResult, ReleaseVerdict
from proxy.handoff.story import RequestStory, StoryStep, request_story

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
    "LifecycleResult",
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
