"""The rows the history keeps: each table's columns, and the rows each decision event becomes (one
event, emitted once, writes its rows once). The store (proxy/admin/telemetry.py) writes and reads them.
"""

from __future__ import annotations

import json
from typing import Literal

from proxy.decision_base import DecisionEvent
from proxy.gpu.keeper import GpuApplyFinished
from proxy.handoff.decisions import (
    DecisionView,
    HandoffFinished,
    LifecycleStart,
    LifecycleStop,
    ModelLoad,
    NothingToRelease,
    OomRetry,
    QueueEnded,
    Rejected,
    SpillNoPlan,
)
from proxy.handoff.plan_json import Blocker
from proxy.models.loads import LoadRecord, MeasuredLoad

Kind = Literal["vram", "decisions", "releases", "rejections", "oom_retries", "model_loads", "load_speeds"]
KINDS: tuple[Kind, ...] = ("vram", "decisions", "releases", "rejections", "oom_retries", "model_loads", "load_speeds")

SCHEMA: dict[Kind, str] = {
    "vram": "at REAL NOT NULL, tenant TEXT NOT NULL, window_s REAL NOT NULL, samples INTEGER NOT NULL,"
            " min_bytes INTEGER NOT NULL, max_bytes INTEGER NOT NULL, last_bytes INTEGER NOT NULL",
    "decisions": "at REAL NOT NULL, decision_id INTEGER NOT NULL, kind TEXT NOT NULL, tenant TEXT NOT NULL,"
                 " trigger TEXT NOT NULL, ok INTEGER, outcome TEXT NOT NULL",
    "releases": "at REAL NOT NULL, decision_id INTEGER NOT NULL, tenant TEXT NOT NULL, requester TEXT NOT NULL,"
                " expected_bytes INTEGER NOT NULL, freed_bytes INTEGER NOT NULL, duration_s REAL NOT NULL,"
                " confirmed INTEGER NOT NULL, error TEXT",
    "rejections": "at REAL NOT NULL, decision_id INTEGER NOT NULL, tenant TEXT NOT NULL, trigger TEXT NOT NULL,"
                  " need_bytes INTEGER, blockers TEXT NOT NULL",
    "oom_retries": "at REAL NOT NULL, decision_id INTEGER NOT NULL, tenant TEXT NOT NULL, result TEXT NOT NULL",
    "model_loads": "at REAL NOT NULL, tenant TEXT NOT NULL, started_at REAL NOT NULL, duration_s REAL NOT NULL,"
                   " grown_bytes INTEGER NOT NULL, gbps REAL",
    # loads the engines timed themselves (proxy/models/loads.py): residency before, warm or cold
    "load_speeds": "at REAL NOT NULL, decision_id INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,"
                   " size_bytes INTEGER NOT NULL, seconds REAL NOT NULL, gbps REAL NOT NULL,"
                   " resident_before_percent REAL, class TEXT, source TEXT NOT NULL",
}
COLUMNS: dict[Kind, tuple[str, ...]] = {
    k: tuple(part.strip().split()[0] for part in schema.split(",")) for k, schema in SCHEMA.items()
}
WITH_DECISION_ID: tuple[Kind, ...] = tuple(k for k in KINDS if "decision_id" in COLUMNS[k])


# The events that complete a decision worth a `decisions` row (its whole view, with every fact merged):
# what ran, how a wait ended, a refusal, a write to the card. An OOM retry with no decision of its
# own is one too (`OomRetry.handoff_id` None). Observations have tables of their own (load_speeds) or none.
_COMPLETING = (HandoffFinished, QueueEnded, Rejected, NothingToRelease, SpillNoPlan, GpuApplyFinished, LifecycleStart,
               LifecycleStop)


def decision_rows(event: DecisionEvent, view: DecisionView | None) -> list[tuple[Kind, dict[str, object]]]:
    """The rows an event adds (each event is emitted once, so each row is written once). `view` is its
    decision as it stands after it (None: no longer kept); rows are dated and numbered by the decision."""
    at = view.at if view is not None else event.at
    decision_id = event.id if (target := event.target()) is None else target
    out: list[tuple[Kind, dict[str, object]]] = []
    if view is not None and completes(event):
        out.append(("decisions", {"at": at, "decision_id": decision_id, "kind": view.kind, "tenant": view.tenant,
                                  "trigger": view.trigger, "ok": view.outcome.get("ok"),
                                  "outcome": json.dumps(view.outcome, default=str)}))
    match event:
        case HandoffFinished(releases=releases):
            out.extend(("releases", {"at": at, "decision_id": decision_id, "tenant": r.tenant, "requester": event.tenant,
                                     "expected_bytes": r.expected_bytes, "freed_bytes": r.freed_bytes,
                                     "duration_s": r.duration_s, "confirmed": r.confirmed, "error": r.error})
                       for r in releases)
        case Rejected(status=507) if event.answered_request:  # a 503 after the queue timeout is a wait that ran out
            out.append(("rejections", {"at": at, "decision_id": decision_id, "tenant": event.tenant,
                                       "trigger": event.trigger, "need_bytes": event.plan.need_bytes,
                                       "blockers": json.dumps([Blocker.of(b).dump() for b in event.plan.blockers], default=str)}))
        case ModelLoad(load=load):
            out.append(("load_speeds", {"at": at, "decision_id": decision_id, "tenant": event.tenant, "model": load.model,
                                        "size_bytes": load.size_bytes, **_load_figures(load)}))
        case OomRetry(result=result):
            out.append(("oom_retries", {"at": at, "decision_id": decision_id, "tenant": event.tenant, "result": result}))
    return out


def completes(event: DecisionEvent) -> bool:
    """The event completes its decision (its `decisions` row is written now; the demo prints its line)."""
    return isinstance(event, _COMPLETING) or (isinstance(event, OomRetry) and event.handoff_id is None)


def _load_figures(load: LoadRecord) -> dict[str, object]:
    """As the load's own rendering rounds them (proxy/models/loads.py)."""
    rendered = MeasuredLoad.of(load)
    return {"seconds": rendered.seconds, "gbps": rendered.gbps,
            "resident_before_percent": rendered.resident_before_percent, "class": load.load_class,
            "source": load.source}
