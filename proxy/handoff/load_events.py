"""Model loads as events: the typed port through which whoever cares about loads (the model-files
extension's warming and load timing, the dashboard's "loading ...") hears about them, instead of
hooking the GPU gate or the arbitration.

Publishers: the scheduler's effects say a load is ahead (`ahead`: memory is being released or
waited for, so its files can be read meanwhile); the GPU gate says a load begins (`begin`: an
admitted request for a model not on the card is forwarded), reaches the card (`arrived`: the
engine's answer began) and ends (`ended`: its answer is over, with its last bytes, where the engine
says how long the load took), and passes each upstream websocket text frame on (`frame`: ComfyUI's
execution frames time its checkpoint loads).

One load is one load: requests for a load already under way (a chat and its title request sent at
once, admitted by the same handoff) join it, so it is timed, recorded and shown once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.clock import Clock
from proxy.handoff.busy import CONFIRM_SLACK_BYTES

log = logging.getLogger("hyperswap.loads")


@dataclass(frozen=True, slots=True)
class Load:
    """One model load on its way to the card, as the request that began it saw it."""

    id: int
    tenant: str
    model: str
    key: str  # the scheduler's load key: requests with the same key wait on the same load
    need_bytes: int  # what the proxy planned for it (an estimate: the adapter's, or tenants.json's)
    began_at: float  # the injected clock's now()
    began_wall: float  # unix seconds
    request: int | None  # the decision of the request that began it (its wait or its handoff)
    body: bytes = field(repr=False, compare=False)  # the request that loads it (a ComfyUI graph names its loaders)
    held_before: int | None = None  # what the tenant held on the card when it began (None: not read yet)


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """How far a load got, from the card: what its tenant gained since the load began (the card shows
    what a process holds, not which model the memory is for)."""

    on_card_bytes: int
    need_bytes: int
    estimated: bool  # True unless the tenant held nothing else when it began and the card was read by NVML


def progress(load: Load, held_now: int, idle_floor: int, card_estimated: bool,
             lowest: int | None = None) -> LoadProgress:
    """The load's figure on a card reading where its tenant holds `held_now`: what it gained since the
    load began (all it holds above its idle floor when that is unknown), at most the planned need;
    `lowest`: the least the tenant was seen to hold since (an engine that evicts its other model first,
    as Ollama does, gains from there). Exact only when the tenant held nothing but its floor then (its
    growth is this load) on a measured card; an estimate otherwise (another model may leave or load too)."""
    base = load.held_before if load.held_before is not None else idle_floor
    if lowest is not None:
        base = min(base, lowest)
    gained = min(max(0, held_now - base), load.need_bytes)
    alone = load.held_before is not None and load.held_before <= idle_floor + CONFIRM_SLACK_BYTES
    return LoadProgress(gained, load.need_bytes, card_estimated or not alone)


class LoadListener(Protocol):
    """What a subscriber hears. Every method but `starting` must return at once (never block, never
    await); `starting` is awaited, bounded by the listener itself, before the load is forwarded (what
    is in RAM must be read before the engine reads the files)."""

    def load_ahead(self, tenant: str, model: str) -> None:
        """This load runs once memory is released or a busy tenant finishes (warm its files now)."""

    async def load_starting(self, load: Load) -> None:
        """The load is about to be forwarded to the engine."""

    def load_ended(self, load: Load, tail: bytes | None) -> None:
        """The answer to the request that began it ended: its last bytes (where an engine says how long
        it loaded), or None when no answer came (an error, the client left) and nothing can be timed."""

    def engine_frame(self, tenant: str, text: str) -> None:
        """An upstream websocket text frame of the tenant (its execution frames may time a load)."""


class LoadEvents:
    """The publisher, and the loads under way (begun, their engine not answering yet)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._listeners: list[LoadListener] = []
        self._ids = itertools.count(1)
        self._begun: dict[tuple[str, str], Load] = {}  # (tenant, key) -> the load under way
        self._lowest: dict[int, int] = {}  # load id -> the least its tenant was seen to hold since it began
        self._answered: dict[int, float] = {}  # load id -> seconds from its begin to the engine's first byte

    def subscribe(self, listener: LoadListener) -> Callable[[], None]:
        """Hear every load from now on; returns the call that stops it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)
        return unsubscribe

    @property
    def listened(self) -> bool:
        return bool(self._listeners)

    def underway(self) -> list[Load]:
        """The loads begun whose engine has not answered yet, oldest first."""
        return sorted(self._begun.values(), key=lambda load: load.id)

    def underway_of(self, tenant: str, key: str | None = None) -> Load | None:
        """The tenant's load under way (this one, with `key`), oldest first."""
        if key is not None:
            return self._begun.get((tenant, key))
        return next((load for load in self.underway() if load.tenant == tenant), None)

    def progress(self, load: Load, held_now: int, idle_floor: int, card_estimated: bool) -> LoadProgress:
        """`progress` on this reading, remembering the least the tenant held since the load began."""
        lowest = min(held_now, self._lowest.get(load.id, held_now))
        if (load.tenant, load.key) in self._begun:
            self._lowest[load.id] = lowest
        return progress(load, held_now, idle_floor, card_estimated, lowest)

    # -- publishing ---------------------------------------------------------------------------------
    def ahead(self, tenant: str, model: str) -> None:
        for listener in list(self._listeners):
            _quietly(listener.load_ahead, tenant, model)

    async def begin(self, tenant: str, model: str, key: str, need_bytes: int, body: bytes,
                    request: int | None, held_before: int | None = None) -> Load | None:
        """A request for a load not on the card is about to be forwarded. None: the same load is under
        way already (this request joins it: nothing is recorded for it)."""
        if (tenant, key) in self._begun:
            return None
        load = Load(next(self._ids), tenant, model, key, need_bytes, self.clock.now(), self.clock.wall(), request, body,
                    held_before)
        self._begun[(tenant, key)] = load
        listeners = list(self._listeners)
        if listeners:
            results = await asyncio.gather(*(listener.load_starting(load) for listener in listeners),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    log.error("a load listener failed at the start of %s", model, exc_info=result)
        return load

    def arrived(self, load: Load) -> None:
        """The engine began its answer: the load is on the card (or failed); it is under way no more."""
        if self._begun.get((load.tenant, load.key)) is load:
            del self._begun[(load.tenant, load.key)]
            self._answered[load.id] = self.clock.now() - load.began_at
        self._lowest.pop(load.id, None)

    def answered_after(self, load: Load) -> float | None:
        """Seconds from the load's begin to the engine's first byte (None: no answer began). The
        proxy's own timing of a load, for when the engine's is lost: a client that closed its answer
        before the engine's last line (where Ollama says `load_duration`) still loaded the model."""
        return self._answered.get(load.id)

    def ended(self, load: Load, tail: bytes | None) -> None:
        """The answer to the request that began the load ended (`tail`: its last bytes; None: none came)."""
        if self._begun.get((load.tenant, load.key)) is load:  # no answer began: nothing to time it from
            del self._begun[(load.tenant, load.key)]
            self._lowest.pop(load.id, None)
        try:
            for listener in list(self._listeners):
                _quietly(listener.load_ended, load, tail)
        finally:
            self._answered.pop(load.id, None)

    def frame(self, tenant: str, text: str) -> None:
        for listener in list(self._listeners):
            _quietly(listener.engine_frame, tenant, text)


def _quietly(call: Callable[..., None], *args: object) -> None:
    """A listener's failure never breaks a request or a handoff."""
    try:
        call(*args)
    except Exception:
        log.exception("a load listener failed")
