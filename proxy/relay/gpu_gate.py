"""The GPU gate: what a tenant listener does with a GPU request. Admit it (the handoff queue may
hold it, then it runs, or gets 507 or 503), forward it, and on an out-of-memory answer reclaim and
retry once. Everything here that builds an HTTP answer is the relay's; the decisions are the
handoff's (`GpuBroker`, `Scheduler`, the pure planner and queue rules).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import httpx
from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.clock import Clock
from proxy.config.schema import Tenant
from proxy.decision_base import RequestTrigger
from proxy.engines import Need, ReleaseFailed, strip_hop_by_hop
from proxy.engines.ports import GatePorts, JobFrame, JobReplay, JobView, OomDetector
from proxy.handoff.broker import GpuBroker
from proxy.handoff.decisions import (
    DecisionEvent,
    DecisionLog,
    FirstByte,
    HandoffFinished,
    HandoffStarted,
    OomRetry,
    Queued,
    QueueEnded,
    Rejected,
    StaleJob,
    WaitChanged,
)
from proxy.handoff.door import Door
from proxy.handoff.inflight import Token
from proxy.handoff.load_events import Load
from proxy.handoff.oom_need import OOM_HEADROOM_BYTES
from proxy.handoff.plan import gib
from proxy.handoff.plan_json import plan_json
from proxy.handoff.policy import RESIDENT
from proxy.handoff.tickets import Admitted, Handoff
from proxy.lifecycle.controller import LifecycleError
from proxy.relay import refusals
from proxy.relay import trace as tracing
from proxy.relay.forward import UpstreamResponse
from proxy.relay.load_line import Reading
from proxy.relay.oom_retry import RetryBook, SocketFrames

# A GPU request's need (None: an unload) and its admission when the scheduler admitted it at once
# (its load on the card; None: it is planned), found before its answer is built.
FirstStep = tuple[Need | None, Admitted | None]

log = logging.getLogger("hyperswap.gate")

WAIT_EVENTS = (Queued, WaitChanged, QueueEnded, HandoffStarted, HandoffFinished)  # a wait may have changed


def request_path(request: Request) -> str:
    """`request.url.path` without building the URL (a parse of the whole address per request, ~10 %
    of a resident request's time in the gate): Starlette's URL is the client's path with `?`, `#`
    and backslash escaped, read back by urlsplit, which drops tabs and line breaks and a trailing
    space. A path none of that touches is the same string; any other is read as Starlette does."""
    path: str = request.scope["path"]
    if path.startswith("/") and path.isprintable() and not path.endswith(" ") \
            and "?" not in path and "#" not in path and "\\" not in path:
        return path
    return URL(scope=request.scope).path


TAIL_BYTES = 4096  # an engine's final line (Ollama's, with load_duration) fits well inside this


class _TailKept(UpstreamResponse):
    """The engine's answer, relayed unchanged, with its last bytes kept: once it ends, `done(tail)`
    (the load it carried is timed from them: proxy/handoff/load_events.py)."""

    __slots__ = ("_done", "_tail")

    def __init__(self, inner: UpstreamResponse, done: Callable[[bytes], None]) -> None:
        super().__init__(inner._response)  # the same open response: nothing is read or copied twice
        self._tail = b""
        self._done: Callable[[bytes], None] | None = done

    def _keep(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk)[-TAIL_BYTES:]

    def received_body(self) -> bytes | None:
        body = super().received_body()
        if body is not None:
            self._keep(body)
        return body

    async def _chunks(self) -> AsyncIterator[bytes]:
        async for chunk in super().aiter_raw():
            self._keep(chunk)
            yield chunk

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def aread(self) -> bytes:
        body = await super().aread()
        self._keep(body)
        self._finish()
        return body

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._finish()

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(self._tail)


class GpuGate:
    """The listener's hook for GPU requests: admit, forward, and on an OOM answer reclaim and retry once.

    Ollama's OOM is an HTTP answer: the kept body is replayed. ComfyUI's arrives later, as an
    `execution_error` frame on a websocket passing through the proxy, or (for a client with no
    websocket) in the /history entry the job poller reads: the same graph is re-queued for the same
    client_id, read back from ComfyUI's own /history entry.
    """

    def __init__(self, broker: GpuBroker, adapter: Callable[[Tenant], GatePorts]) -> None:
        self.broker = broker
        self.door: Door = broker.scheduler  # the request side's only way into the scheduler (handoff/door.py)
        self._adapter = adapter  # each tenant's engine adapter (the proxy's, shared with the broker and the watchdog)
        self._retries = RetryBook()  # jobs retried under their own id (proxy/relay/oom_retry.py)
        self._told: dict[tuple[str, str], int] = {}  # (tenant, job) re-queued -> the decision its result joins
        self._early_ends: dict[tuple[str, str], JobFrame] = {}  # a retried run that ended before its re-queue was recorded
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def clock(self) -> Clock:
        return self.broker.clock

    def wait_of(self, work: Token) -> dict[str, Any] | None:
        return self.door.wait_of(work)

    def watch_waits(self, changed: Callable[[], None]) -> Callable[[], None]:
        def on_event(event: DecisionEvent) -> None:
            if isinstance(event, WAIT_EVENTS):
                changed()
        return self.broker.decisions.subscribe(on_event)

    async def _load_figure(self, tenant: Tenant, need: Need) -> Reading | None:
        """How far a load got, from the card (`load_events.progress`: what the tenant gained since the
        load began); the line a person reads is proxy/relay/load_line.py's."""
        snap = await self.broker.snapshot()
        load = self.broker.loads.underway_of(tenant.name, need.key)
        if load is None:
            return None  # not begun yet, or on the card already
        figure = self.broker.loads.progress(load, snap.held_by(tenant.name), tenant.idle_vram_bytes, snap.estimated)
        return Reading(load.model, figure.on_card_bytes, figure.need_bytes, load.began_at, self.broker.clock.now())

    def on_frame(self, tenant: Tenant, text: str) -> None:
        """Called for every upstream text frame of a tenant's websockets (the adapter filters cheaply first)."""
        self.broker.loads.frame(tenant.name, text)  # ComfyUI's execution frames time its checkpoint loads

    def frames(self, tenant: Tenant, later: Callable[[str], None]) -> SocketFrames:
        """One websocket's filter (proxy/relay/oom_retry.py): it tells the gate of each job frame (an
        OOM starts the retry) and holds back the failed run's frames while its retry is decided;
        `later` relays one that was held back. `unwatch` it when the socket closes."""
        adapter = self._adapter(tenant)
        return self._retries.watch(tenant.name, adapter.job_frame, partial(self._job_frame, tenant), later)

    def unwatch(self, frames: SocketFrames) -> None:
        self._retries.unwatch(frames)

    def client_view(self, tenant: Tenant, view: JobView, body: bytes) -> bytes | None:
        """The engine's history or queue answer as the client must see it (None: unchanged): a retried
        job's failed run left out of the history until the new run's record replaces it, and listed
        pending in the queue while its retry is decided."""
        if view == "queue":
            waiting = self._retries.waiting(tenant.name)
            return self._adapter(tenant).queue_with(body, waiting) if waiting else None
        if view == "jobs":
            if not self._retries.pending(tenant.name):
                return None
            return self._adapter(tenant).jobs_without(body, partial(self._retries.hidden, tenant.name),
                                                      self._retries.retried(tenant.name))
        return self.history_view(tenant, body)

    def history_view(self, tenant: Tenant, body: bytes) -> bytes | None:
        """The engine's history answer as the client must see it: a retried job's failed run left out
        until the new run's record replaces it. None: unchanged. A read is also where an out-of-memory
        of a job the proxy counts may show first (a client polling its history can read it before the
        proxy's own poll or the error frame): its retry starts here, and the client never reads it."""
        adapter = self._adapter(tenant)
        for job in self.broker.inflight.jobs(tenant.name):
            if job.encode() in body and self._retries.phase(tenant.name, job) is None \
                    and adapter.history_outcome(job, body) == "oom":  # read only once its id is there: a job ended
                self._job_frame(tenant, JobFrame("oom", job), 1)
        if not self._retries.pending(tenant.name):
            return None
        return adapter.history_without(body, partial(self._retries.hidden, tenant.name))

    def watches_views(self, tenant: Tenant) -> bool:
        return bool(self.broker.inflight.jobs(tenant.name)) or self._retries.pending(tenant.name)

    def retry_deciding(self, tenant: Tenant, job_id: str) -> bool:
        """The job's failed run ended and whether it runs again is being decided: it is not lost."""
        return self._retries.phase(tenant.name, job_id) == "deciding"

    def on_job_end(self, tenant: Tenant, job_id: str, history: bytes) -> None:
        """A prompt's end found by the history poll (its client never opened a websocket, so no
        frame told us), from the record the client sees: the first run's out-of-memory starts the
        retry; a retried job's record is the new run's, and says how the retry went."""
        outcome = self._adapter(tenant).history_outcome(job_id, history)
        if outcome is not None:
            self._job_frame(tenant, JobFrame(outcome, job_id), 1 if self._retries.phase(tenant.name, job_id) is None else 2)

    def on_job_lost(self, tenant: Tenant, job_id: str) -> None:
        self.broker.decisions.emit(StaleJob(
            tenant=tenant.name, trigger="job reconciliation", job_id=job_id,
            reason=f"{job_id} is in neither {tenant.name}'s queue nor its history (deleted from the queue, or the "
                   "engine restarted): no longer counted as running"))
        self.door.kick()

    def _job_frame(self, tenant: Tenant, frame: JobFrame, run: int) -> None:
        """A job's frame (or history record) of its `run`: the first run's out-of-memory starts its
        retry, once however many sockets and polls report it; the end of the new run is the retry's result."""
        if self._closed or frame.kind in ("start", "end"):
            return
        if run <= 1:
            if frame.kind == "oom" and self._retries.begin(tenant.name, frame.job_id):
                task = asyncio.create_task(self._retry_prompt(tenant, frame.job_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        if self._retries.end(tenant.name, frame.job_id):
            result = "succeeded" if frame.kind == "success" else "failed"
            told = self._told.pop((tenant.name, frame.job_id), None)
            self.broker.decisions.emit(OomRetry(tenant=tenant.name, trigger=f"end of prompt {frame.job_id}",
                                                     result=result, handoff_id=told, prompt_id=frame.job_id))
        elif frame.kind == "success" and self._retries.phase(tenant.name, frame.job_id) not in ("ended", "given_up"):
            # the new run (the first one failed) ended before its re-queue's answer came back (a fast engine,
            # a client reading /history meanwhile): told once the re-queue is recorded
            self._early_ends[(tenant.name, frame.job_id)] = frame

    async def _retry_prompt(self, tenant: Tenant, prompt_id: str) -> None:
        """Queue the prompt again under its own id, for the same client, once the scheduler admitted it
        on a fresh card reading; every out-of-memory is retried once, whatever the new plan says. What
        the client sees waits for this: the failed run's frames are dropped once it is queued, relayed
        when it is not."""
        adapter = self._adapter(tenant)
        queued = False
        try:
            replay = await self._job_replay(adapter, prompt_id)
            if replay is None:
                self._record_retry(tenant, None, "not retried: prompt not in ComfyUI's history", prompt_id=prompt_id)
                return
            self._retries.replaying(tenant.name, prompt_id, replay)
            admitted, _need = await self.broker.admit(tenant, "", replay.body,
                                                           f"OOM of ComfyUI prompt {prompt_id}", oom=True)
            handoff = admitted.handoff
            try:
                if admitted.outcome != "run":
                    self._record_retry(tenant, handoff, "no plan", prompt_id=prompt_id)
                    return
                requeued = await adapter.resubmit(self.broker.control, replay)
                if requeued.job_id is None:
                    self._record_retry(tenant, handoff, f"re-queue refused: {requeued.status}", prompt_id=prompt_id)
                    return
                self.broker.inflight.track_job(tenant.name, requeued.job_id)
                if requeued.job_id == prompt_id:
                    queued = True
                    self._retries.requeued(tenant.name, prompt_id, requeued.mark)
                told = self._record_retry(tenant, handoff, "requeued", prompt_id=prompt_id, requeued_as=requeued.job_id)
                if queued:
                    self._told[(tenant.name, prompt_id)] = told
                    while len(self._told) > 4096:
                        self._told.pop(next(iter(self._told)))
                    if (early := self._early_ends.pop((tenant.name, prompt_id), None)) is not None:
                        self._job_frame(tenant, early, 2)
            except (httpx.HTTPError, ValueError, ReleaseFailed) as exc:
                self._record_retry(tenant, handoff, f"re-queue failed: {exc}", prompt_id=prompt_id)
            finally:
                self.door.settle_when_idle(handoff)  # the re-queued prompt loads after POST /prompt returns
        finally:
            if not queued:  # no retry under the client's id (or an engine that gave it a new one): the error stands
                self._retries.given_up(tenant.name, prompt_id)

    async def _job_replay(self, adapter: OomDetector, job_id: str) -> JobReplay | None:
        """The engine writes the failed job down shortly after its error frame: look for a while."""
        for _ in range(50):
            replay = await adapter.job_replay(self.broker.control, job_id)
            if replay is not None:
                return replay
            await self.broker.clock.sleep(0.1)
        return None

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def dormant(self, tenant: Tenant) -> bool:
        return self.broker.lifecycles.dormant(tenant.name)

    async def wake(self, tenant: Tenant, what: str, *, reads_only: bool = False,
                   origin: str | None = None) -> Response | None:
        """Before anything reaches a tenant that sleeps (stopped by the proxy, or owing a resume): room
        is made for it like for a load, then it is started (one start shared by every request that
        waits for it). None: it is awake, forward. Else the answer: 507, 503 after the queue timeout,
        or 503 with the reason and the app's last output lines when the start failed.

        `reads_only`: the request only reads and the tenant's `wake_on` is "writes"; `origin`: a
        browser's Origin the listener does not allow. Neither starts a tenant that sleeps (a poll
        must not make it flap, a foreign page must not start it): they are answered with the reason,
        or join a start already under way. A request that did start it counts as activity, so the
        idle release counts from its start, not from before."""
        if reads_only or origin is not None:
            refusal = self._kept_asleep(tenant, what, origin)
            if refusal is not None:
                return refusal
        trace = tracing.current()
        arrived, arrived_wall = self.broker.clock.now(), self.broker.clock.wall()
        parked = self.broker.lifecycles.suspensions.parked_bytes(tenant.name)  # cuda_suspend: a restore
        if trace is not None and self.broker.lifecycles.dormant(tenant.name):
            # a streamed request is answered now and hears the start (or the restore)
            trace.wait(f"resuming {tenant.name}: {parked / 2**30:.1f} GiB back from host RAM" if parked
                       else f"starting {tenant.name}")
        try:
            admitted = await self.broker.starter.wake(tenant, f"start of {tenant.name} for {what}")
        except LifecycleError as exc:
            return refusals.start_failed(exc).response()
        if admitted is None:
            return None
        if admitted.outcome == "run":
            self.broker.inflight.active(tenant.name)  # woken for this request: its ttl counts from now
            if trace is not None:
                handoff = admitted.handoff
                waited_wall = arrived_wall + handoff.waited_s
                record_wait(trace, self.broker.decisions, handoff, arrived_wall, waited_wall)
                took = self.broker.clock.now() - arrived - handoff.waited_s
                done = "restored from host RAM" if parked else "started"
                trace.phase("start", took, f"{done} {tenant.name}")
                trace.say(f"{tenant.name} {done} in {took:.1f} s")
            return None
        if admitted.outcome == "timeout":
            self.broker.decisions.emit(Rejected(tenant=tenant.name, trigger=f"start for {what}",
                                             plan=admitted.handoff.plan, status=503, reason=admitted.reason))
            return refusals.queue_timeout(tenant, admitted, self.broker.registry.config.proxy.queue_timeout_s).response()
        return refusals.not_enough_memory(tenant, admitted.handoff, self.broker.starter.start_need(tenant).bytes).response()

    def _kept_asleep(self, tenant: Tenant, what: str, origin: str | None) -> Response | None:
        """The answer to a request that must not wake `tenant` (a read, a foreign Origin), if it sleeps
        and no start is under way to join; None: go on (it is awake, or starting)."""
        lifecycles = self.broker.lifecycles
        if not lifecycles.dormant(tenant.name):
            return None
        machine = lifecycles.machine(tenant.name)
        state = machine.state if machine is not None else "released"
        if state == "starting":
            return None  # the start under way is shared, as for any request
        start = f"POST http://{self.broker.registry.config.admin.listen}/api/tenants/{tenant.name}/start"
        last_error = machine.snapshot.error if machine is not None else None
        return refusals.kept_asleep(tenant, state, last_error, what=what, origin=origin, start_url=start).response()

    async def at_once(self, tenant: Tenant, request: Request, body: bytes, work: Token) -> FirstStep:
        """The need, and the scheduler's at-once admission of a load already on the card (or on its
        way), tried before anything else is built for the request (a streamed one's progress answer):
        such a request never waits. No admission: `handle` plans it with the need found here (none
        for an unload, which needs no memory)."""
        adapter, path = self._adapter(tenant), request_path(request)
        if adapter.unload_target(path, body) is not None:
            return None, None
        need = await adapter.estimate_need(path, body, self.broker.control)
        return need, self.door.admit_at_once(tenant, need.key, need.bytes, work)

    async def handle(self, tenant: Tenant, request: Request, body: bytes,
                     forward: Callable[[bytes], Awaitable[UpstreamResponse]], work: Token,
                     first: FirstStep = (None, None)) -> UpstreamResponse | Response:
        """Admit (unless `at_once` did: `first`, whose need is not estimated again), forward, retry
        once after an OOM."""
        adapter, path = self._adapter(tenant), request_path(request)
        unloading = adapter.unload_target(path, body)
        if unloading is not None:
            # An unload loads nothing: it needs no memory, releases nobody and is never refused.
            self.door.admit_unplanned(work, tenant.name, adapter.load_key(unloading))
            return await forward(body)
        trigger = RequestTrigger.of(request.method, path)
        arrived, arrived_wall = self.broker.clock.now(), self.broker.clock.wall()
        admitted, need = await self._admit(tenant, path, body, trigger, work, first)
        handoff = admitted.handoff
        if admitted.outcome != "run":
            return self._refused(tenant, admitted, need, trigger)
        outlives = adapter.captures_job(request.method, path)
        loads = need.model is not None and admitted.reason != RESIDENT  # on the card already: nothing to time
        trace = tracing.current()
        self._trace_admission(trace, tenant, need, handoff, arrived_wall, loads)
        # a streamed answer's first byte times a load; none to time on the card already: not parsed again
        streamed = loads and adapter.stream_format(path, body) is not None
        forwarded = self.broker.clock.now()
        story = _story_of(handoff)
        events = self.broker.loads
        load = await self._begin_load(tenant, need, body, story) if loads else None
        timed = False  # the load's end is told when its answer ends
        try:
            response = await forward(body)
            if load is not None:
                events.arrived(load)
            self._first_byte(tenant, trigger, need, response, trace, story, loaded=loads and streamed,
                             arrived=(arrived, arrived_wall), forwarded=forwarded)
            if response.status_code < 400:
                self.door.loaded(tenant.name, need.key)
                if load is not None and events.listened:
                    response = _TailKept(response, partial(events.ended, load))  # the engine's own load time
                    timed = True
            if not adapter.answers_oom or response.status_code < 400:
                return response
            return await self._after_error(tenant, adapter, request, body, forward, handoff, need, trigger, response)
        finally:
            if load is not None and not timed:
                events.ended(load, None)  # no answer to time it from
            self._settle(handoff, outlives)

    async def _admit(self, tenant: Tenant, path: str, body: bytes, trigger: str, work: Token,
                     first: FirstStep) -> tuple[Admitted, Need]:
        """The request's admission: the one `at_once` found, or the queue's (on the need `at_once`
        estimated, when it did)."""
        known, at_once = first
        if at_once is not None and known is not None:
            return at_once, known
        return await self.broker.admit(tenant, path, body, trigger, work=work, need=known)

    def _first_byte(self, tenant: Tenant, trigger: str, need: Need, response: UpstreamResponse,
                    trace: tracing.Trace | None, story: int | None, *, loaded: bool,
                    arrived: tuple[float, float], forwarded: float) -> None:
        """The engine's first byte: told to the request's trace (a streamed answer of a load: the load's
        time) and, when it waited or loaded (`story`), recorded as a fact of its decision. `arrived`:
        (monotonic, wall) when the request came."""
        now = self.broker.clock.now()
        if trace is not None:
            self._trace_answer(trace, need, loaded=loaded and response.status_code < 400, took=now - forwarded)
        if story is not None:
            self.broker.decisions.emit(FirstByte(tenant=tenant.name, trigger=trigger, refers_to=story,
                                                      arrived_at=arrived[1], after_s=now - arrived[0],
                                                      status=response.status_code))

    def _settle(self, handoff: Handoff, outlives: bool) -> None:
        """The answer ended: the request's promise ends with it, or (`outlives`: a job the engine runs
        after answering, a ComfyUI prompt) once its tenant has no work any more."""
        if outlives:
            self.door.settle_when_idle(handoff)  # the job loads after the answer: keep its memory promised
        else:
            self.door.settle(handoff)

    async def handle_unkept(self, tenant: Tenant, request: Request, head: bytes,
                            forward: Callable[[], Awaitable[UpstreamResponse]], work: Token) -> UpstreamResponse | Response:
        """A GPU request whose body is too large to keep (over replay_body_max_mb, or any body with
        0): planned like any other, through the same scheduler (one door), on the need its head names;
        only the OOM retry is given up (the body cannot be sent twice), and its decision says so."""
        adapter, path = self._adapter(tenant), request_path(request)
        need = await adapter.head_need(path, head, self.broker.control)
        trigger = (f"{RequestTrigger.of(request.method, path)} (body over replay_body_max_mb="
                   f"{tenant.replay_body_max_mb:g}: not kept, so no OOM retry)")
        admitted, need = await self.broker.admit(tenant, path, b"", trigger, work=work, need=need)
        if admitted.outcome != "run":
            return self._refused(tenant, admitted, need, trigger)
        try:
            response = await forward()
            if response.status_code < 400:
                self.door.loaded(tenant.name, need.key)
            return response
        finally:
            self._settle(admitted.handoff, adapter.captures_job(request.method, path))

    async def _after_error(self, tenant: Tenant, adapter: GatePorts, request: Request, body: bytes,
                           forward: Callable[[bytes], Awaitable[UpstreamResponse]], handoff: Handoff, need: Need,
                           trigger: str, response: UpstreamResponse) -> UpstreamResponse | Response:
        """An error answer: replayed as it came, unless the engine ran out of memory; then room is made
        and the request sent once more (its answer, or the error with the plan that found no room)."""
        error_body = await response.aread()
        await response.aclose()
        if not adapter.response_is_oom(response.status_code, error_body):
            return _replay_response(response, error_body)
        # The first try is over: its reservation goes before the retry reserves its bigger need
        # (under the same key it would only have counted once more, with the old size and baseline).
        self.door.settle(handoff)
        # Every OOM is retried once, admitted on a fresh card reading (`GpuBroker.admit`): memory
        # that freed since the first try is room too, not a reason to give up.
        again, _ = await self.broker.admit(tenant, request_path(request), body, f"OOM answer to {trigger}", oom=True)
        retry = again.handoff
        try:
            outcome = "retried" if again.outcome == "run" else "no plan"
            if outcome == "retried":
                response = await forward(body)
                if response.status_code < 400:
                    self.door.loaded(tenant.name, need.key)
                    self._record_retry(tenant, retry, "succeeded")
                    return response
                error_body = await response.aread()
                await response.aclose()
            self._record_retry(tenant, retry, "failed" if outcome == "retried" else outcome)
            if retry.plan.blockers or retry.plan.unplanned:
                return _with_blockers(response, error_body, retry)
            # The retry ran on all it could reach: who holds the rest is what a plan past it names.
            past, snap = await self.broker.plan(tenant.name, retry.plan.need_bytes + OOM_HEADROOM_BYTES, need.key)
            return _with_blockers(response, error_body, Handoff(past, [], None, snap))
        finally:
            self.door.settle(retry)

    def _refused(self, tenant: Tenant, admitted: Admitted, need: Need, trigger: str) -> Response:
        """The answer to a request the queue did not admit: 503 past the queue timeout (recorded as a
        rejection here: the scheduler only ended its wait), else 507."""
        if admitted.outcome == "timeout":
            self.broker.decisions.emit(Rejected(tenant=tenant.name, trigger=trigger, plan=admitted.handoff.plan, status=503,
                                             reason=admitted.reason))
            return refusals.queue_timeout(tenant, admitted, self.broker.registry.config.proxy.queue_timeout_s).response()
        return refusals.not_enough_memory(tenant, admitted.handoff, need.bytes).response()

    async def _begin_load(self, tenant: Tenant, need: Need, body: bytes, story: int | None) -> Load | None:
        """The first request for a load begins it; one for the same load under way joins it (one load,
        one record: None)."""
        if need.model is None:
            return None
        card = self.door.card
        return await self.broker.loads.begin(tenant.name, need.model, need.key, need.bytes, body, story,
                                          card.held_by(tenant.name) if card is not None else None)

    def _trace_admission(self, trace: tracing.Trace | None, tenant: Tenant, need: Need, handoff: Handoff,
                         arrived_wall: float, loads: bool) -> None:
        if trace is None:
            return
        if handoff.queued is not None or isinstance(handoff.decision, HandoffStarted):  # else it waited for nothing
            record_wait(trace, self.broker.decisions, handoff, arrived_wall, self.broker.clock.wall(),
                        used_ago=partial(self._used_ago, arrived_wall))
        if loads:
            trace.say(f"loading {need.model} ({gib(need.bytes)} GiB)")
            trace.loading = partial(self._load_figure, tenant, need)

    def _used_ago(self, arrived_wall: float, tenant: str) -> float | None:
        """Seconds from the tenant's last use to a request's arrival (negative: used since)."""
        last = self.broker.inflight.traffic(tenant).last_activity
        clock = self.broker.clock
        return None if last is None else (clock.now() - last) - (clock.wall() - arrived_wall)

    @staticmethod
    def _trace_answer(trace: tracing.Trace, need: Need, *, loaded: bool, took: float) -> None:
        """`loaded`: a streamed answer's headers came once the model was loaded (and its first token made)."""
        if loaded:
            trace.phase("load", took, f"{need.model}: until the engine's first byte")
            trace.say(f"{need.model} loaded in {took:.1f} s")
        trace.loading = None

    def _record_retry(self, tenant: Tenant, handoff: Handoff | None, result: str, *, prompt_id: str | None = None,
                      requeued_as: str | None = None) -> int:
        """When the retry's result is known (a job re-queued: when it is, and again when it ends): a
        fact of the decision the retry got from the queue (the handoff that made room for it, or its
        507), if it got one, else a decision of its own. Returns the decision it is part of."""
        started = handoff.decision if handoff is not None else None
        event = self.broker.decisions.emit(OomRetry(tenant=tenant.name, trigger="OOM answer", result=result,
                                                 handoff_id=started.id if started is not None else None,
                                                 prompt_id=prompt_id, requeued_as=requeued_as))
        return started.id if started is not None else event.id


def _story_of(handoff: Handoff) -> int | None:
    """The decision a request's story hangs on: its wait, else the handoff it caused (GET /api/decisions/{id})."""
    if handoff.queued is not None:
        return handoff.queued
    return handoff.decision.id if isinstance(handoff.decision, HandoffStarted) else None


def record_wait(trace: tracing.Trace, decisions: DecisionLog, handoff: Handoff, arrived_wall: float,
                admitted_wall: float, used_ago: Callable[[str], float | None] = lambda _tenant: None) -> None:
    """The wait of an admitted request as phases: `queue` (it waited in the queue, up to the release
    made for it, or to its admission) and `release` (from the release's start, or the request's
    arrival when it joined one under way, to its admission), so the two add up to the wait; and a
    progress line for each release."""
    started = handoff.decision if isinstance(handoff.decision, HandoffStarted) else None
    released = [r for r in handoff.releases if not r.busy] if started is not None else []
    release_from = max(arrived_wall, started.at) if started is not None and released else admitted_wall
    if handoff.queued is not None:
        view = decisions.view(handoff.queued)
        outcome = view.read() if view is not None else None
        who = ", ".join(outcome.waiting_for or ()) if outcome is not None else ""
        reason = (outcome.reason or "") if outcome is not None else ""
        tracing.queue_phase(trace, release_from - arrived_wall, reason, who, used_ago)  # a hold, or a wait
    if released:
        trace.phase("release", admitted_wall - release_from,
                    ", ".join(f"released {r.tenant} ({gib(r.freed_bytes)} GiB)" for r in released))
        for r in released:
            how = "" if r.confirmed else f" ({r.error or r.result})"
            trace.say(f"{r.tenant} released: {gib(r.freed_bytes)} GiB back in {r.duration_s:.1f} s{how}")


def _replay_response(upstream: UpstreamResponse, body: bytes) -> Response:
    """The upstream's answer, already read, as it was: repeated headers kept, framing re-done."""
    response = Response(body, status_code=upstream.status_code)
    length = (b"content-length", b"%d" % len(body))
    headers = [length if k == b"content-length" else (k, v) for k, v in strip_hop_by_hop(upstream.raw_headers)]
    response.raw_headers = headers if length in headers else [*headers, length]  # order kept, as the engine sent it
    return response


def _with_blockers(upstream: UpstreamResponse, body: bytes, handoff: Handoff | None) -> Response:
    try:
        data = json.loads(body)
    except ValueError:
        return _replay_response(upstream, body)
    if isinstance(data, dict) and handoff is not None:
        data["blockers"] = refusals.blockers_json(handoff)
        data["plan"] = plan_json(handoff.plan)
    return JSONResponse(data, status_code=upstream.status_code)
