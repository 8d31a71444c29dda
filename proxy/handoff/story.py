"""One request's story, told from the typed events of its decisions (`request_story`): arrived, waited
for whom, the releases, the load, the first byte (`GET /api/decisions/{id}`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.decision_base import DecisionEvent, E, RequestTrigger
from proxy.handoff.decision_events import FirstByte, HandoffFinished, HandoffStarted, ModelLoad, Queued, QueueEnded, WaitChanged
from proxy.handoff.plan import gib
from proxy.handoff.policy import held_swap


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
