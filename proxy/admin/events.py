"""GET /api/events: server-sent events for the dashboard and anyone who wants to watch.

Frames (each with an `id:` line; the stream opens with a `retry:` hint so EventSource reconnects):
- `catalog`: the installed models per tenant (Ollama /api/tags names and sizes, ComfyUI checkpoint
  names). Large and rarely changing, so it goes in a subscriber's first frame and again only when it
  changes. One background task refreshes it at most every `catalog_refresh_s`, for all subscribers.
- `stats`: one a second, and at once (within `event_gap_s`) after anything that changes what it
  shows: a decision (a wait, a handoff, a release's end), a load beginning or reaching the card, a
  lifecycle change. So the dashboard shows a handoff as it happens, not up to a second late (issue
  41). Device, tenants (VRAM, busy, in flight, idle-release countdown, a load under way), processes,
  recent decision ids. Small on purpose: no tenant config, no catalog.
- `decision`: a decision as it stands after each of its events (the shape of GET /api/decisions:
  a later fact, like a handoff's results, re-sends its decision's id with the fact merged in).
- `lifecycle`: a tenant the proxy starts and stops changed state, when it happened: with its report
  when a start or stop ends or the app ends on its own (from `Lifecycles.on_report`), without one for
  the changes on the way (starting, stopping: from `Lifecycles.on_state`, on the next loop turn, so a
  change that comes with a report is sent once).

Each subscriber has a bounded queue: a slow one loses its oldest stats frames (the next one
supersedes them) and older catalogs, never a decision; one so far behind that decisions alone pass
the bound is closed instead, and on reconnect (Last-Event-ID) gets the decisions it missed from a
small replay ring. Nothing here ever waits on a subscriber, so the proxy and other subscribers go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from proxy.admin import views
from proxy.admin.proxy_view import ProxyView
from proxy.decision_base import DecisionEvent
from proxy.encoding import JSONObject
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.decision_json import Decision
from proxy.handoff.load_events import Load
from proxy.lifecycle import report_json
from proxy.lifecycle.state import LifecycleReport
from proxy.tasks import cancel_and_wait, sleep_or_wake

log = logging.getLogger("hyperswap.events")

FrameKind = Literal["stats", "catalog", "decision", "lifecycle"]


@dataclass(frozen=True, slots=True)
class EventsSettings:
    tick_s: float = 1.0
    event_gap_s: float = 0.05  # after an event, a stats frame this soon: a burst of events (a handoff's) makes one
    catalog_refresh_s: float = 10.0
    stats_backlog: int = 2  # stats frames a subscriber may have queued; older ones are dropped
    max_queued: int = 1000  # past this (decisions alone) the subscriber is closed, never silently trimmed
    replay: int = 200  # decision frames kept for Last-Event-ID on reconnect
    retry_ms: int = 2000
    first_catalog_wait_s: float = 2.0  # a subscriber right after start-up waits this long for the first catalog
    catalog_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Frame:
    seq: int
    kind: FrameKind
    data: bytes


def encode(seq: int, kind: FrameKind, payload: object) -> Frame:
    body = json.dumps(payload, separators=(",", ":"), default=str)  # one line: no newline inside `data:`
    return Frame(seq, kind, f"id: {seq}\nevent: {kind}\ndata: {body}\n\n".encode())


@dataclass(slots=True, eq=False)  # identity: kept in a set
class _Subscriber:
    settings: EventsSettings
    frames: deque[Frame] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stats_queued: int = 0
    overflowed: bool = False
    closing: bool = False

    def push(self, frame: Frame) -> None:
        if frame.kind == "stats":
            if self.stats_queued >= self.settings.stats_backlog:
                self._drop_oldest("stats")
            self.stats_queued += 1
        elif frame.kind == "catalog":
            self._drop_oldest("catalog")  # superseded by this one
        self.frames.append(frame)
        if len(self.frames) > self.settings.max_queued:
            self.overflowed = True
        self.wake.set()

    def _drop_oldest(self, kind: FrameKind) -> None:
        for i, f in enumerate(self.frames):
            if f.kind == kind:
                del self.frames[i]
                if kind == "stats":
                    self.stats_queued -= 1
                return

    def pop(self) -> Frame:
        frame = self.frames.popleft()
        if frame.kind == "stats":
            self.stats_queued -= 1
        return frame


# -- payloads -------------------------------------------------------------------------------------

async def stats_payload(proxy: ProxyView, snap: AttributedSnapshot | None = None, recent: int = 20) -> JSONObject:
    """One stats frame's body (no catalog, no tenant config: those are large and static)."""
    broker = proxy.broker
    snap = snap or await broker.snapshot()
    states = broker.scheduler.states(snap)
    tenants = [views.stats_tenant(broker, proxy.watchdog, snap, t, states[t.name]) for t in broker.registry]
    frame = views.StatsFrame(
        device=views.device_view(snap),
        tenants=tenants,
        processes=[views.card_process(p, cmdline=False) for p in snap.processes],
        in_flight=sum(t.in_flight for t in tenants),
        busy=[t.name for t in tenants if t.busy],
        decision_ids=[d.id for d in broker.decisions.recent(recent)],
        handoff_in_progress=bool(broker.scheduler.releasing),
        queue=[views.Waiting.model_validate(w) for w in views.queue(broker)],
        gpu_error=views.gpu_error_view(broker.last_read_error),
    )
    return views.dump(frame)


# -- the extension --------------------------------------------------------------------------------

class EventsExtension:
    def __init__(self, proxy: ProxyView, settings: EventsSettings | None = None) -> None:
        self.proxy = proxy
        self.settings = settings or EventsSettings()
        self._seq = itertools.count(1)
        self._subs: set[_Subscriber] = set()
        self._replay: deque[Frame] = deque(maxlen=self.settings.replay)
        self.catalog: dict[str, dict[str, object]] | None = None
        self._catalog_frame: Frame | None = None
        self._catalog_ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: Callable[[], None] | None = None
        self._lifecycle_sent: dict[str, str] = {}  # tenant -> the state its last lifecycle frame said
        self._changed = asyncio.Event()  # something a stats frame shows changed: the next one now
        self._unsubscribe_loads: Callable[[], None] | None = None

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    def routes(self) -> list[BaseRoute]:
        return [Route("/api/events", self.events, methods=["GET"])]

    async def start(self) -> None:
        self._unsubscribe = self.proxy.decisions.subscribe(self._on_decision)
        self._unsubscribe_loads = self.proxy.broker.loads.subscribe(_LoadsChange(self._changed))
        lifecycles = self.proxy.broker.lifecycles
        lifecycles.on_report.append(self._on_lifecycle)
        lifecycles.on_state.append(self._on_lifecycle_state)
        self._lifecycle_sent = {name: m.state for name, m in lifecycles.machines().items()}
        self._tasks = [asyncio.create_task(self._tick_loop(), name="events:stats"),
                       asyncio.create_task(self._catalog_loop(), name="events:catalog")]

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._unsubscribe_loads is not None:
            self._unsubscribe_loads()
            self._unsubscribe_loads = None
        with contextlib.suppress(ValueError):
            self.proxy.broker.lifecycles.on_report.remove(self._on_lifecycle)
        with contextlib.suppress(ValueError):
            self.proxy.broker.lifecycles.on_state.remove(self._on_lifecycle_state)
        self._close_all()
        await cancel_and_wait(self._tasks)
        self._tasks.clear()

    # -- fan-out (never awaits: called from inside handoffs) ----------------------------------
    def _broadcast(self, frame: Frame) -> None:
        for sub in list(self._subs):
            sub.push(frame)
            if sub.overflowed:  # its stream ends on wake; stop feeding it even if it never ran
                self._subs.discard(sub)

    def _on_decision(self, event: DecisionEvent) -> None:
        view = self.proxy.decisions.view_of(event)  # the decision with this fact merged in: the dashboard's shape
        if view is None:
            return  # a later fact of a decision too old to be kept: there is no entry left to show it in
        frame = encode(next(self._seq), "decision", Decision.of(view).dump())
        self._replay.append(frame)
        self._broadcast(frame)
        self._changed.set()

    def _on_lifecycle(self, report: LifecycleReport) -> None:
        self._lifecycle_frame(report.tenant, report)
        self._changed.set()

    def _on_lifecycle_state(self, tenant: str) -> None:
        asyncio.get_running_loop().call_soon(self._lifecycle_changed, tenant)

    def _lifecycle_changed(self, tenant: str) -> None:
        machine = self.proxy.broker.lifecycles.machine(tenant)
        if machine is not None and self._lifecycle_sent.get(tenant) != machine.state:
            self._lifecycle_frame(tenant, None)

    def _lifecycle_frame(self, tenant: str, report: LifecycleReport | None) -> None:
        machine = self.proxy.broker.lifecycles.machine(tenant)
        if machine is None:
            return
        view = machine.view()
        self._lifecycle_sent[tenant] = str(view["state"])
        frame = views.LifecycleFrame(tenant=tenant, lifecycle=views.Lifecycle.model_validate(view),
                                     report=None if report is None else report_json.LifecycleReport.of(report))
        self._broadcast(encode(next(self._seq), "lifecycle", views.dump(frame)))

    def _lifecycle_changes(self) -> None:
        """States that changed with no report (a start or stop on its way): one frame each."""
        for name, machine in self.proxy.broker.lifecycles.machines().items():
            if self._lifecycle_sent.get(name) != machine.state:
                self._lifecycle_frame(name, None)

    def _close_all(self) -> None:
        for sub in self._subs:
            sub.closing = True
            sub.wake.set()

    def _admin_stopping(self) -> bool:
        # The proxy stops its servers before its extensions; an open stream would hold uvicorn's
        # shutdown until its force-exit timeout, so streams end as soon as the admin server is told to exit.
        admin = self.proxy.servers.get("admin")
        return admin is not None and admin.server.should_exit

    # -- background work ----------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        clock = self.proxy.clock
        while True:
            if self._admin_stopping():
                self._close_all()
            elif self._subs:
                try:
                    self._lifecycle_changes()
                    payload = await stats_payload(self.proxy)
                    frame = encode(next(self._seq), "stats", payload)
                    self._broadcast(frame)
                except Exception:  # a bad tick must not end the stream for everyone
                    log.exception("events: stats frame failed")
            self._changed.clear()
            await sleep_or_wake(clock, self.settings.tick_s, self._changed)
            if self._changed.is_set():
                await clock.sleep(self.settings.event_gap_s)  # the rest of the burst joins this frame

    async def refresh_catalog(self) -> bool:
        """Fetch every tenant's catalog; broadcast it if it changed. True when it changed."""
        client = self.proxy.broker.control
        catalog: dict[str, dict[str, object]] = {}
        previous = self.catalog or {}
        for tenant in self.proxy.registry:
            try:
                listed = await self.proxy.engines(tenant).catalog(client, self.settings.catalog_timeout_s)
                entry = None if listed is None else listed.model_dump(mode="json", exclude_unset=True)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                old = previous.get(tenant.name) or {"engine": tenant.engine, "models": []}
                entry = {**old, "error": f"could not list models: {exc.__class__.__name__}: {exc}"}
            if entry is not None:
                catalog[tenant.name] = entry
        changed = catalog != self.catalog
        if changed:
            self.catalog = catalog
            self._catalog_frame = encode(next(self._seq), "catalog", {"tenants": catalog})
            self._broadcast(self._catalog_frame)
        self._catalog_ready.set()
        return changed

    async def _catalog_loop(self) -> None:
        while True:
            try:
                await self.refresh_catalog()
            except Exception:
                log.exception("events: catalog refresh failed")
                self._catalog_ready.set()
            await self.proxy.clock.sleep(self.settings.catalog_refresh_s)

    # -- the route ----------------------------------------------------------------------------
    async def events(self, request: Request) -> Response:
        last_id = _int_or_none(request.headers.get("last-event-id"))
        sub = _Subscriber(self.settings)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(self._stream(sub, last_id), media_type="text/event-stream", headers=headers)

    async def _stream(self, sub: _Subscriber, last_id: int | None) -> AsyncIterator[bytes]:
        self._subs.add(sub)  # from now on decisions queue up for it, so none is missed while we start
        try:
            yield f"retry: {self.settings.retry_ms}\n\n".encode()
            if not self._catalog_ready.is_set():
                try:
                    await asyncio.wait_for(self._catalog_ready.wait(), self.settings.first_catalog_wait_s)
                except TimeoutError:
                    pass
            # A catalog broadcast while waiting is already queued; send the current one first and drop that copy.
            sub._drop_oldest("catalog")
            if self._catalog_frame is not None:
                yield self._catalog_frame.data
            if last_id is not None:
                queued = {f.seq for f in sub.frames}
                for f in list(self._replay):
                    if f.seq > last_id and f.seq not in queued:
                        yield f.data
            payload = await stats_payload(self.proxy)
            while sub.stats_queued:  # ticks queued while it was built are older: this one supersedes them
                sub._drop_oldest("stats")
            yield encode(next(self._seq), "stats", payload).data  # its id taken once built: stats ids rise
            while not sub.overflowed:
                if sub.frames:
                    yield sub.pop().data
                    continue
                if sub.closing:
                    break
                sub.wake.clear()
                await sub.wake.wait()
        finally:
            self._subs.discard(sub)
            if sub.overflowed:
                log.warning("events: closed a subscriber %d frames behind (it reconnects with Last-Event-ID)",
                            len(sub.frames))


class _LoadsChange:
    """A load beginning, reaching the card or ending changes a stats frame (a tenant's `loading`)."""

    def __init__(self, changed: asyncio.Event) -> None:
        self._changed = changed

    def load_ahead(self, tenant: str, model: str) -> None:
        pass

    async def load_starting(self, load: Load) -> None:
        self._changed.set()

    def load_ended(self, load: Load, tail: bytes | None) -> None:
        self._changed.set()

    def engine_frame(self, tenant: str, text: str) -> None:
        pass


def _int_or_none(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def events_extension(proxy: ProxyView) -> EventsExtension:
    return EventsExtension(proxy)
