"""A decision as JSON: the one shape `GET /api/decisions`, the events stream, the stats and the admin
API's document write and describe (`Decision.of(view)`), and a request's story (`RequestStory.of`).

An outcome is the facts of a decision's events merged (proxy/handoff/decisions.py), so every key of
it is optional: it grows as the decision goes on (a handoff's releases come with its second event).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.decision_base import DecisionKind
from proxy.encoding import JSONModel
from proxy.handoff import decisions
from proxy.handoff.outcome import DecisionOutcome
from proxy.handoff.plan_json import Plan


class Decision(JSONModel):
    id: int
    at: float = Field(description="unix seconds")
    kind: DecisionKind
    tenant: str
    trigger: str
    plan: Plan | None
    outcome: DecisionOutcome

    @classmethod
    def of(cls, view: decisions.DecisionView) -> Decision:
        return cls(id=view.id, at=round(view.at, 3), kind=view.kind, tenant=view.tenant, trigger=view.trigger,
                   plan=None if view.plan is None else Plan.model_validate(view.plan),
                   outcome=DecisionOutcome.model_validate(view.outcome))


class StoryStep(JSONModel):
    """One bar of a request's waterfall, in seconds from its arrival."""
    kind: Literal["wait", "hold", "release", "load", "first_byte"]
    text: str = Field(description="the bar's sentence: 'waited 4.1 s behind comfyui', 'released comfyui in 0.5 s'...")
    start_s: float
    duration_s: float
    decision: int = Field(description="the decision it is told from")
    tenant: str | None = Field(description="wait: whom it waited for; release: who was released; load: the requester")

    @classmethod
    def of(cls, s: decisions.StoryStep) -> StoryStep:
        return cls(kind=s.kind, text=s.text, start_s=round(s.start_s, 3), duration_s=round(s.duration_s, 3),
                   decision=s.decision, tenant=s.tenant)


class RequestStory(JSONModel):
    """Why one GPU request that waited or caused a handoff took as long as it did."""
    request: int = Field(description="the decision the story hangs on: the request's wait, else the handoff it caused")
    tenant: str
    trigger: str
    arrived_at: float = Field(description="unix seconds")
    first_byte_s: float | None = Field(description="null: no answer yet, or it was refused")
    steps: list[StoryStep]
    related: list[int] = Field(description="the decisions it is told from")

    @classmethod
    def of(cls, story: decisions.RequestStory) -> RequestStory:
        return cls(request=story.request, tenant=story.tenant, trigger=story.trigger,
                   arrived_at=round(story.arrived_at, 3), first_byte_s=story.first_byte_s,
                   steps=[StoryStep.of(s) for s in story.steps], related=list(story.related))
