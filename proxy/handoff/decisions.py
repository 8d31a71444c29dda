"""The decision log: every plan, release, rejection and retry, as data.

Each entry is logged as one JSON line (people grep them) *before* the plan runs, kept in a bounded
ring for `GET /api/decisions`, and handed to subscribers (the events stream, telemetry).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.clock import Clock

log = logging.getLogger("hyperswap.decisions")

# model_load: an observation (a load's speed), recorded for the history; gpu_*: proxy/gpu/keeper.py
DecisionKind = Literal["plan", "queued", "release", "rejection", "oom_retry", "idle_release", "spill", "stale_job",
                       "gpu_drift", "gpu_apply", "model_load", "start", "stop", "resume"]


@dataclass(slots=True)
class Decision:
    id: int
    at: float  # unix seconds
    kind: DecisionKind
    tenant: str
    trigger: str  # what asked: "request POST /api/generate", "watchdog idle", "admin"
    plan: dict[str, Any] | None = None
    outcome: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "at": round(self.at, 3), "kind": self.kind, "tenant": self.tenant,
                "trigger": self.trigger, "plan": self.plan, "outcome": self.outcome}


class DecisionLog:
    def __init__(self, clock: Clock, maxlen: int = 500) -> None:
        self._clock = clock
        self._entries: deque[Decision] = deque(maxlen=maxlen)
        self._last_id = 0
        self._subscribers: list[Callable[[Decision], None]] = []

    def continue_after(self, last_id: int) -> None:
        """Number the next decision after `last_id` (the telemetry store's newest), so an id names
        one decision across restarts; never goes back."""
        self._last_id = max(self._last_id, last_id)

    def record(self, kind: DecisionKind, tenant: str, trigger: str, plan: dict[str, Any] | None = None,
               **outcome: Any) -> Decision:
        self._last_id += 1
        d = Decision(self._last_id, self._clock.wall(), kind, tenant, trigger, plan, dict(outcome))
        self._entries.append(d)
        log.info(json.dumps({"decision": d.to_json()}, default=str))
        self._notify(d)
        return d

    def update(self, d: Decision, **outcome: Any) -> None:
        """Add the outcome once it is known (the plan was logged before it ran)."""
        d.outcome.update(outcome)
        log.info(json.dumps({"outcome": {"id": d.id, **d.outcome}}, default=str))
        self._notify(d)

    def recent(self, limit: int = 100) -> list[Decision]:
        return list(self._entries)[-limit:]

    def subscribe(self, fn: Callable[[Decision], None]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def _notify(self, d: Decision) -> None:
        for fn in list(self._subscribers):
            try:
                fn(d)
            except Exception:  # a broken subscriber must not break a handoff
                log.exception("decision subscriber failed")
