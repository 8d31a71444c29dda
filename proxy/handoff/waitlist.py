"""The scheduler's waiting requests (`Ticket`s by id) and the questions each pass asks of them:
which are planned (not waiting on a release under way), which wait for a tenant, which joined a
release, which has run out of time, and when the next deadline comes; and the queue's decisions
of a wait (`Queued` when a request first waits, `WaitChanged` when what it waits for changes,
`QueueEnded` when it leaves). Bookkeeping only: the scheduler (`scheduler.py`) adds, resolves and
changes the tickets.
"""

from __future__ import annotations

from proxy.handoff.decisions import DecisionLog, Queued, QueueEnd, QueueEnded, WaitChanged
from proxy.handoff.inflight import Token
from proxy.handoff.policy import Verdict
from proxy.handoff.tickets import QUEUE_END, Admitted, Ticket, Underway


class WaitList(dict[int, Ticket]):
    """Waiter id -> its ticket, in arrival order."""

    def planned(self) -> list[Ticket]:
        """The tickets each pass plans for: those not already waiting on a release under way."""
        return [t for t in self.values() if t.joined is None]

    def joined_to(self, underway: Underway) -> list[Ticket]:
        """The tickets admitted when this release reports back."""
        return [t for t in self.values() if t.joined is underway]

    def of_work(self, work: Token) -> Ticket | None:
        """The ticket of the request whose traffic token is `work`."""
        return next((t for t in self.values() if t.work is work), None)

    def waiting_for(self, tenant: str) -> list[Ticket] | None:
        """The waiters whose last verdict waits for `tenant` (to finish, or behind its held swap); None
        while a waiter has no verdict yet (it may be one of them)."""
        blocking: list[Ticket] = []
        for t in self.planned():
            if t.verdict is None:
                return None
            if t.verdict.action == "wait" and (tenant in t.verdict.plan.wait_for or tenant in t.verdict.held):
                blocking.append(t)
        return blocking

    def overdue(self, now: float, timeout_s: float) -> list[Ticket]:
        """Planned tickets past `proxy.queue_timeout_s`. A waiter whose release is under way is not
        cut off: the release has a timeout of its own, and its memory is coming."""
        return [t for t in self.planned() if now - t.waiter.arrived_at >= timeout_s]

    def next_pause(self, now: float, timeout_s: float, starvation_s: float, replan_s: float) -> float:
        """How long the driver may sleep: until the next queue timeout, the next waiter that ages past
        the fairness bound, the end of a held swap, or `replan_s`, whichever comes first."""
        planned = self.planned()
        first_deadline = min((t.waiter.arrived_at + timeout_s for t in planned), default=now + replan_s)
        next_aging = min((t.waiter.arrived_at + starvation_s for t in planned
                          if t.waiter.arrived_at + starvation_s > now), default=now + replan_s)
        hold_end = min((t.verdict.held_until for t in planned
                        if t.verdict is not None and t.verdict.held_until is not None and t.verdict.held_until > now),
                       default=now + replan_s)  # a held swap starts at its hold's end
        return max(0.0, min(replan_s, first_deadline - now, next_aging - now, hold_end - now))


def note_wait(decisions: DecisionLog, ticket: Ticket, v: Verdict) -> None:
    """A pass says the ticket waits: `Queued` the first time, `WaitChanged` when the reason changed."""
    if ticket.queued is None:
        ticket.queued = decisions.emit(Queued(tenant=v.waiter.tenant, trigger=ticket.trigger, plan=v.plan,
                                              reason=v.reason, behind=v.behind, waiting_for=v.waiting_for))
    elif ticket.wait_reason != v.reason:
        decisions.emit(WaitChanged(tenant=v.waiter.tenant, trigger=ticket.trigger, refers_to=ticket.queued.id,
                                   reason=v.reason, waiting_for=v.waiting_for, behind=v.behind))
    ticket.wait_reason = v.reason


def note_resolved(decisions: DecisionLog, ticket: Ticket, admitted: Admitted) -> None:
    """A ticket that waited got its answer (`admitted`, its `waited_s` set): its wait ends, by whom and why."""
    if ticket.queued is None:
        return
    admitted.handoff.queued = ticket.queued.id
    by = admitted.handoff.decision
    decisions.emit(QueueEnded(tenant=ticket.queued.tenant, trigger=ticket.trigger, refers_to=ticket.queued.id,
                              result=QUEUE_END[admitted.outcome], waited_s=admitted.handoff.waited_s,
                              ended_by=by.id if by is not None else None, ended_with=admitted.reason))


def note_end(decisions: DecisionLog, ticket: Ticket, why: QueueEnd, now: float) -> None:
    """A ticket that waited left the queue without an answer (its client went away)."""
    if ticket.queued is not None:
        decisions.emit(QueueEnded(tenant=ticket.queued.tenant, trigger=ticket.trigger, refers_to=ticket.queued.id,
                                  result=why, waited_s=now - ticket.waiter.arrived_at))
