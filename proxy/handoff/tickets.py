"""The scheduler's bookkeeping of one request and one release: what a waiting request holds
(`Ticket`), a release under way (`Underway`), and what a request got (`Admitted`, its `Handoff`).
Data only: the scheduler (`scheduler.py`) is the one that changes them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.decisions import HandoffKind, HandoffStarted, Queued, QueueEnd, Rejected, ReleaseResult
from proxy.handoff.inflight import Token
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import Plan, gib
from proxy.handoff.policy import Releasing, Verdict, Waiter


@dataclass(slots=True)
class Handoff:
    plan: Plan
    releases: list[ReleaseResult]
    decision: HandoffStarted | Rejected | None  # the handoff that made room for it, or its 507
    snapshot: AttributedSnapshot | None = None
    reservation: str | None = None  # the key memory was reserved under; `Scheduler.settle` gives it back
    waited_s: float = 0.0
    queued: int | None = None  # the request's `queued` decision, when it had to wait



Outcome = Literal["run", "refuse", "timeout"]
QUEUE_END: dict[Outcome, QueueEnd] = {"run": "admitted", "refuse": "refused (507)", "timeout": "timed out (503)"}


@dataclass(slots=True)
class Admitted:
    """What a waiting request got: run (forward it), refuse (507) or timeout (503)."""
    outcome: Outcome
    handoff: Handoff
    reason: str


@dataclass(slots=True, eq=False)
class Ticket:
    waiter: Waiter
    trigger: str
    kind: HandoffKind  # "plan" or "oom_retry": the decision kind if releases run
    future: asyncio.Future[Admitted]
    since_wall: float
    verdict: Verdict | None = None
    queued: Queued | None = None  # emitted when it first had to wait
    wait_reason: str = ""  # what the last `Queued` or `WaitChanged` said it waits for
    model: str | None = None  # what the load reads from disk, for `prepare_load`
    joined: Underway | None = None  # the release it waits on: admitted when that reports back
    work: Token | None = None  # the request's traffic token: work from its admission on, never before
    overtaken: int = 0  # resident requests that went ahead of it while it waited to swap their tenant away


@dataclass(slots=True, eq=False)
class Underway:
    """A release running as a task (or next in line for its turn): what the next passes must leave
    alone, who waits on it, and the future its other callers (the watchdog, the admin API) await."""
    state: Releasing
    order: ReleaseOrder
    done: asyncio.Future[Released]
    task: asyncio.Task[Released] | None = None  # None: waits for the release ahead of it

    @property
    def claim(self) -> tuple[str, int] | None:
        """What the load it makes room for will take from memory that is free now (the rest comes
        from the release): promised to it, so no later waiter takes it meanwhile."""
        plan = self.order.plan
        if plan is None or self.state.key is None:
            return None
        return plan.requester, max(0, plan.need_bytes - plan.held_by_requester - plan.expected_free_bytes)


def wait_entry(t: Ticket, now: float) -> dict[str, Any]:
    v = t.verdict
    if t.joined is not None:
        reason = f"releasing {', '.join(t.joined.state.tenants)} for it"
    else:
        reason = v.reason if v and v.action == "wait" else "being planned"
    return {"id": t.waiter.id, "tenant": t.waiter.tenant, "trigger": t.trigger,
            "since": round(t.since_wall, 3), "waited_s": round(now - t.waiter.arrived_at, 3),
            "need_bytes": t.waiter.need_bytes, "need_gb": gib(t.waiter.need_bytes),
            "priority": t.waiter.priority, "overtaken": t.overtaken,
            "waiting_for": list(v.waiting_for) if v and t.joined is None else [],
            "behind": v.behind if v and t.joined is None else None,
            "reason": reason}
