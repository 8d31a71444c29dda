"""What every decision event is: a typed, immutable fact, emitted once, when it is known.

A decision (a plan carried out, a wait, a rejection, an OOM retry, a GPU settings write...) is
told as events: one that opens it (`Opening`: an entry of `GET /api/decisions`, with its kind) and,
for those that take time, later facts about it (`FollowUp`: they carry the id of the decision they
refer to and never change it). The decision log (proxy/handoff/decisions.py) numbers them, logs each
as one JSON line, and keeps the view people and the dashboard read: an opening with its follow-ups'
facts merged into its `outcome`.

Here, in the core, so every layer can emit: the GPU settings keeper (proxy/gpu/) defines its own
events, the handoff layer the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, TypeVar

from pydantic import Field

from proxy.encoding import JSONModel, JSONObject

# The kinds of decisions GET /api/decisions lists. model_load: an observation (a load's speed), kept
# for the history; gpu_*: proxy/gpu/keeper.py; start/stop: a lifecycle tenant started or stopped; exit: it
# ended on its own while running (a crash, an exit, no answer).
DecisionKind = Literal["plan", "queued", "release", "rejection", "oom_retry", "idle_release", "spill", "stale_job",
                       "gpu_drift", "gpu_apply", "model_load", "start", "stop", "resume", "exit"]


class RequestTrigger(str):
    """The trigger of a client's GPU request, "request POST /api/generate": a plain string wherever it is
    logged, stored or shown, and typed, so that what was asked by a request (its plan, its wait, its
    refusal: a request's story, the 507s counted) is known by its type, never by reading the text."""

    __slots__ = ()

    @classmethod
    def of(cls, method: str, path: str) -> RequestTrigger:
        return cls(f"request {method} {path}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionEvent:
    """The base: whose decision, what asked for it, and (given by the log) its id and time."""

    name: ClassVar[str] = "event"  # the event's name in its log line: "queued", "handoff_finished"...
    tenant: str  # the tenant it is about ("" for the card itself)
    trigger: str  # what asked: a RequestTrigger ("request POST /api/generate"), "watchdog idle", "admin"
    id: int = 0  # numbered by the log when emitted (0: not emitted yet)
    at: float = 0.0  # unix seconds, stamped by the log

    def target(self) -> int | None:
        """The id of the earlier decision this event is a later fact of; None: it opens a decision."""
        return None

    def facts(self) -> JSONObject:
        """What it adds to its decision's `outcome`, as JSON."""
        return {}

    def line(self) -> DecisionLine:
        """The JSON log line's body (one object per line: people grep them)."""
        out = DecisionLine(id=self.id, at=round(self.at, 3), event=self.name, tenant=self.tenant, trigger=self.trigger,
                           outcome=self.facts())
        target = self.target()
        if target is not None:
            out.refers_to = target
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Opening(DecisionEvent):
    """An event that opens a decision of its own: an entry of GET /api/decisions."""

    kind: DecisionKind

    def plan_json(self) -> JSONObject | None:
        """The plan it carries out or answers with, as JSON; None: no plan."""
        return None

    def line(self) -> DecisionLine:
        out = DecisionEvent.line(self)
        out.kind, out.plan = self.kind, self.plan_json()
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowUp(DecisionEvent):
    """A later fact about an earlier decision (its result, how a wait ended): merged into its view."""

    refers_to: int  # the id of the decision it is a fact of

    def target(self) -> int | None:
        return self.refers_to


class DecisionLine(JSONModel):
    """One line of the decision log, `{"decision": {...}}`: an event as it was emitted. Keys a kind of
    event does not have are absent (a follow-up has no kind and no plan; an opening refers to nothing)."""
    id: int
    at: float = Field(description="unix seconds")
    event: str = Field(description="the event's name: queued, handoff_started, handoff_finished, ...")
    refers_to: int | None = Field(default=None, description="a follow-up: the decision it is a later fact of")
    kind: DecisionKind | None = Field(default=None, description="an opening: its decision's kind")
    plan: JSONObject | None = Field(default=None, description="an opening: the plan it carries out or answers with")
    tenant: str
    trigger: str
    outcome: JSONObject = Field(description="what it adds to its decision's outcome")


E = TypeVar("E", bound=DecisionEvent)


class DecisionSink(Protocol):
    """Where events go: `proxy.handoff.decisions.DecisionLog`, for layers that come before it."""

    def emit(self, event: E) -> E:
        """Number, log and hand on the event; returns it with its id and time."""
        ...
