"""A plan as JSON: the one shape the decision log, the dry run, the 507 and 503 bodies and the
admin API's document all write and describe (`Plan.of(plan).dump()`, or `plan_json`).

Figures a plan could not measure are null, not 0: an unplanned request (the card's size unknown) was
measured against nothing, so its free, held and reachable memory and whether it fits are unknown.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.encoding import JSONModel, JSONObject
from proxy.handoff import plan as planning
from proxy.handoff.plan import gib


class Release(JSONModel):
    tenant: str
    expected_free_bytes: int
    expected_free_gib: float | None
    pids: list[int]
    reason: str

    @classmethod
    def of(cls, r: planning.Release) -> Release:
        return cls(tenant=r.tenant, expected_free_bytes=r.expected_free_bytes, expected_free_gib=gib(r.expected_free_bytes),
                   pids=list(r.pids), reason=r.reason)


class Blocker(JSONModel):
    pid: int | None
    name: str
    tenant: str
    vram_bytes: int | None
    vram_gib: float | None = None
    reason: str = Field(description="why it could not be released: busy, not_reclaimable, priority, unmanaged, ...")
    detail: str

    @classmethod
    def of(cls, b: planning.Blocker) -> Blocker:
        return cls(pid=b.pid, name=b.name, tenant=b.tenant, vram_bytes=b.vram_bytes, vram_gib=gib(b.vram_bytes),
                   reason=b.reason, detail=b.detail)


class PlanDevice(JSONModel):
    index: int = Field(description="NVML index (`nvidia-smi -L`)")
    name: str
    uuid: str | None = Field(default=None, description="in a 507's `device`")


class Plan(JSONModel):
    """A release plan as computed by the planner (`handoff/plan.py`, logged before it runs)."""
    requester: str
    need_bytes: int
    need_gib: float | None
    free_bytes: int | None = Field(description="null when unplanned: nothing was measured")
    free_gib: float | None
    held_by_requester_bytes: int | None
    held_by_requester_gib: float | None
    promised_bytes: int = Field(default=0, description="free memory already promised to admitted loads still on their way")
    promised_gib: float | None = None
    reachable_bytes: int | None = Field(default=0, description="free + held + every reclaimable tenant's memory, busy "
                                                                 "or idle; null when unplanned")
    reachable_gib: float | None = None
    feasible: bool | None = Field(description="enough now, with the releases listed; null: unknown (unplanned)")
    possible: bool | None = Field(default=True, description="enough once the busy tenants in wait_for finish; "
                                                            "false: 507; null: unknown (unplanned)")
    outcome: Literal["ready", "release", "wait", "impossible", "unplanned"] | None = Field(
        default=None, description="unplanned: the card's size is unknown (no GPU reader, no engine reports the "
                                  "device), so the request is forwarded without a plan; the explanation says why")
    starved: bool | None = Field(description="free + already held is below the need (only then is anything released); "
                                            "null: unknown (unplanned)")
    estimated: bool = Field(description="memory figures are the engines' own reports (GPU reader failed)")
    releases: list[Release]
    wait_for: list[str] = Field(default_factory=list, description="busy tenants the request waits for")
    blockers: list[Blocker]
    explanation: str
    device: PlanDevice | None = Field(default=None, description="only on a host with several GPUs: the card planned on")

    @classmethod
    def of(cls, plan: planning.Plan) -> Plan:
        # an unplanned request was measured against nothing: its figures are unknown, not 0; whether it
        # fits is unknown, not yes (it is forwarded because nothing can be planned)
        known = not plan.unplanned
        free = plan.free_bytes if known else None
        held = plan.held_by_requester if known else None
        reach = plan.reachable_bytes if known else None
        out = cls(requester=plan.requester, need_bytes=plan.need_bytes, need_gib=gib(plan.need_bytes),
                  free_bytes=free, free_gib=gib(free), held_by_requester_bytes=held, held_by_requester_gib=gib(held),
                  promised_bytes=plan.promised_bytes, promised_gib=gib(plan.promised_bytes),
                  reachable_bytes=reach, reachable_gib=gib(reach),
                  feasible=plan.feasible if known else None, possible=plan.possible if known else None,
                  outcome=plan.outcome, starved=plan.starved if known else None, estimated=plan.estimated,
                  releases=[Release.of(r) for r in plan.releases], wait_for=list(plan.wait_for),
                  blockers=[Blocker.of(b) for b in plan.blockers], explanation=plan.explanation)
        if plan.device is not None:  # only on a host with several cards: one card's plans stay as they were
            out.device = PlanDevice(index=plan.device, name=plan.device_name)
        return out


def plan_json(plan: planning.Plan) -> JSONObject:
    """The plan as every answer and log line carries it."""
    return Plan.of(plan).dump()
