"""The oracle of bench/mixed.py: the shortest makespan any order could give a small burst on one card.

Pure (no sockets, no clock): the bench measures the service times on its box and hands them in.

The model of the card, per request kind (one kind per tenant: renders are ComfyUI's, chats Ollama's,
transcriptions the speech relay's, each with one model):
- a tenant serves its requests one at a time (ComfyUI has one worker, Ollama one slot per model, the
  relay is timed the same way), `run_s` each while its model is on the card;
- a tenant whose model is not on the card loads it first (`load_s`: a checkpoint or model load, the
  relay's start); the card must hold every resident model idle (`rest_bytes`), the released tenants
  at their floor (a CUDA context), plus what the one serving adds at its peak (`peak_bytes`:
  ComfyUI's working memory while sampling), so an idle checkpoint may stay beside a model that
  could not be loaded while it renders;
- to make room, resident tenants are released (`release_s`, in parallel, from the ask to the memory
  back on the card), each only once its earlier work is done, never before the request that needs
  the room has arrived (nobody can release for a request not yet sent); a load waits for residents
  that could not serve beside it to finish;
- tenants that fit together run at the same time; changes of what is resident happen in the order
  chosen (a load never starts before the previous change of residency did), so the card never holds
  more than it can.

`best_schedule` tries every order in which the requests could be served (by default every
interleaving of the kinds, requests of one kind first come first served: with equal service times
serving an earlier arrival first is never worse, which `fifo=False`, every permutation, confirms in
tests/unit/test_bench_oracle.py) and every choice of whom to release, and returns the one with the
earliest last finish (ties: fewer handoffs). Up to 8 requests: at most 8! orders.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Service:
    """How one kind of request behaves on the box (seconds and bytes, measured there)."""

    run_s: float  # one request with its model on the card
    load_s: float  # added when the model must be loaded (or the app started) first
    release_s: float  # from asking the tenant to let go to the memory back on the card
    peak_bytes: int  # what the tenant holds on the card while it serves
    floor_bytes: int = 0  # what it keeps once released (its CUDA context; 0 when the process is gone)
    rest_bytes: int | None = None  # what it holds idle with its model loaded (None: its peak)

    @property
    def rest(self) -> int:
        return self.peak_bytes if self.rest_bytes is None else self.rest_bytes

    @property
    def extra(self) -> int:
        """What serving adds to its rest (ComfyUI's working memory while sampling)."""
        return self.peak_bytes - self.rest


@dataclass(frozen=True, slots=True)
class Schedule:
    makespan_s: float  # from time 0 (the first send) to the last request's end
    order: str  # the kinds in the order they were served (loads and releases happen in this order)
    handoffs: int  # loads that had to release someone first
    finish_s: tuple[float, ...]  # each request's end, by its index in the burst


def at_rest(resident: frozenset[str], services: Mapping[str, Service]) -> int:
    """Bytes on the card with these kinds' models loaded and idle, every other tenant at its floor."""
    return sum(s.rest if k in resident else s.floor_bytes for k, s in services.items())


def fits(resident: frozenset[str], services: Mapping[str, Service], capacity_bytes: int, serving: str | None = None) -> bool:
    """Whether these kinds' models can be on the card together, idle, or with `serving` at its peak."""
    return at_rest(resident, services) + (services[serving].extra if serving else 0) <= capacity_bytes


@dataclass(slots=True)
class _State:
    resident: frozenset[str]
    free: dict[str, float]  # when each tenant's last scheduled request ends
    epoch: float  # when the last change of residency began
    finish: list[float]
    handoffs: int
    begin: list[float]  # when the card began working for each request (its release, load or run)
    last_begin: float = 0.0  # the begin of the request just served


def _choices(state: _State, kind: str, arrival: float, services: Mapping[str, Service],
             capacity_bytes: int) -> list[_State]:
    """Every way to serve one request of `kind` next. Its model is loaded first unless resident; idle
    tenants are released first (the victims) when the card cannot hold the rest together with it
    serving at its peak. A load waits for the residents that could not serve beside it to finish
    what they were doing (their later requests release it again, or wait)."""
    svc = services[kind]
    out: list[_State] = []
    resident = kind in state.resident
    others = sorted(state.resident - {kind})
    for n in range(len(others) + 1):
        for victims in itertools.combinations(others, n):
            after = (state.resident - set(victims)) | {kind}
            if not fits(after, services, capacity_bytes, serving=kind):
                continue
            if resident and not victims:  # it runs as it is: no change of residency
                begin = max(arrival, state.free.get(kind, 0.0))
                out.append(_State(state.resident, {**state.free, kind: begin + svc.run_s}, state.epoch, state.finish,
                                  state.handoffs, state.begin, begin))
                continue
            cramped = [r for r in after - {kind} if not fits(after, services, capacity_bytes, serving=r)]
            begin = max([arrival, state.epoch, *(state.free.get(v, 0.0) for v in (*victims, *cramped))])
            if resident:
                begin = max(begin, state.free.get(kind, 0.0))
            ready = begin + max((services[v].release_s for v in victims), default=0.0) + (0.0 if resident else svc.load_s)
            out.append(_State(after, {**state.free, kind: ready + svc.run_s}, begin, state.finish,
                              state.handoffs + (1 if victims else 0), state.begin, begin))
    return out


def conserving(arrivals: Sequence[float], begin: Sequence[float], finish: Sequence[float]) -> bool:
    """Whether the card never sat idle while a request that had arrived waited: every request's wait
    (its arrival to the card's first work for it) is covered by work for other requests."""
    eps = 1e-9
    for j, (a, b) in enumerate(zip(arrivals, begin, strict=True)):
        covered = a
        for lo, hi in sorted((begin[i], finish[i]) for i in range(len(begin)) if i != j):
            if covered >= b - eps or lo > covered + eps:
                break
            covered = max(covered, hi)
        if covered < b - eps:
            return False
    return True


def best_schedule(kinds: str, arrivals: Sequence[float], resident: frozenset[str], services: Mapping[str, Service],
                  capacity_bytes: int, *, fifo: bool = True, work_conserving: bool = False) -> Schedule:
    """The order (and releases) with the earliest last finish for requests of `kinds` (one letter per
    request) sent at `arrivals` (seconds from the first send), the card holding `resident` kinds'
    models at time 0. Raises ValueError when a kind cannot fit on the card even alone.

    The oracle knows the whole burst at time 0: it may keep a request waiting on an idle card for one
    not sent yet (serve the chats that are coming before swapping away from their model). With
    `work_conserving` only schedules that never do are counted (`conserving`): the best a scheduler
    can do that serves what has arrived without waiting to see what comes next."""
    if len(kinds) != len(arrivals):
        raise ValueError(f"{len(kinds)} requests but {len(arrivals)} arrival times")
    for k in set(kinds):
        if not fits(frozenset({k}), services, capacity_bytes, serving=k):
            raise ValueError(f"{k} does not fit on the card even alone")
    by_kind = {k: [i for i, c in enumerate(kinds) if c == k] for k in sorted(set(kinds))}
    best: list[Schedule] = [Schedule(math.inf, "", 0, ())]

    def visit(state: _State, done: frozenset[int], order: str) -> None:
        span = max((state.finish[i] for i in done), default=0.0)
        if span > best[0].makespan_s or (span == best[0].makespan_s and state.handoffs >= best[0].handoffs):
            return  # no better than the best found: every request finishes at or after its predecessors'
        if len(done) == len(kinds):
            if not work_conserving or conserving(arrivals, state.begin, state.finish):
                best[0] = Schedule(span, order, state.handoffs, tuple(state.finish))
            return
        if fifo:
            nexts = [next(i for i in idx if i not in done) for idx in by_kind.values() if any(i not in done for i in idx)]
        else:
            nexts = [i for i in range(len(kinds)) if i not in done]
        for i in nexts:
            for after in _choices(state, kinds[i], arrivals[i], services, capacity_bytes):
                after.finish = [*state.finish[:i], after.free[kinds[i]], *state.finish[i + 1:]]
                after.begin = [*state.begin[:i], after.last_begin, *state.begin[i + 1:]]
                visit(after, done | {i}, order + kinds[i])

    visit(_State(frozenset(resident), {}, 0.0, [0.0] * len(kinds), 0, [0.0] * len(kinds)), frozenset(), "")
    return best[0]
