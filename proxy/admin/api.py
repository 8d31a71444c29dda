"""The admin API (default 127.0.0.1:11400): tenants with live state, release, dry-run plans, decisions.

Read-mostly: the mutations (release, start, stop) take the scheduler's one release path, one at a time
with every other release.
When a token is configured every mutating call needs `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from proxy.admin import views
from proxy.admin.query import integer, optional_number
from proxy.config.bounds import MAX_GIB
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.encoding import JSONObject
from proxy.engines.ports import SelfReport
from proxy.errors import HyperSwapError, error_body
from proxy.handoff.broker import GpuBroker, ReleaseResult
from proxy.handoff.decision_json import Decision, RequestStory
from proxy.handoff.decisions import NothingToRelease, Rejected
from proxy.handoff.orders import release_whole, stop_whole
from proxy.handoff.plan_json import plan_json
from proxy.handoff.release_result import ReleaseOutcome
from proxy.handoff.tickets import Admitted
from proxy.handoff.watchdog import Watchdog
from proxy.hosts import listener_policy
from proxy.lifecycle import report_json
from proxy.lifecycle.logs import (
    FOLLOW_EVERY_S,
    LINES_BACK_DEFAULT,
    LINES_BACK_MAX,
    MAX_FOLLOWERS,
    Chunk,
    LogFollower,
)
from proxy.lifecycle.process import ProcessController
from proxy.lifecycle.state import TenantLifecycle
from proxy.relay import refusals
from proxy.relay.guards import AdminGuard

Handler = Callable[[Request], Awaitable[Response]]
LOG_KEEPALIVE_S = 15.0  # a quiet log stream sends a comment this often


def refusal(message: str, fix: str | None = None, **details: object) -> JSONObject:
    """An error answer's body: the sentence, the fix, and details."""
    return error_body(message, fix, details)


def error(status: int, message: str, fix: str | None = None, **details: object) -> JSONResponse:
    return JSONResponse(refusal(message, fix, **details), status_code=status)


def _stop_outcomes(results: list[dict[str, object]]) -> tuple[list[object], list[object], list[object]]:
    """The tenants stopped, refused (busy or starting: left running) and failed (any other stop not done)."""
    stopped = [r["tenant"] for r in results if r["ok"]]
    refused = [r["tenant"] for r in results if not r["ok"] and r.get("reason") in ("busy", "starting")]
    failed = [r["tenant"] for r in results if not r["ok"] and r["tenant"] not in refused]
    return stopped, refused, failed


def _stop_all_answer(results: list[dict[str, object]]) -> dict[str, object]:
    """Stop-all's answer from each tenant's result: those stopped, refused (busy or starting) and
    failed; the error and fix when any was not stopped, a note when there was nothing to stop."""
    stopped, refused, failed = _stop_outcomes(results)
    answer: dict[str, object] = {"ok": not refused and not failed, "stopped": stopped, "refused": refused,
                                 "failed": failed, "results": results}
    if refused or failed:
        answer["error"] = "not stopped: " + "; ".join(f"{r['tenant']} ({r['error']})" for r in results if not r["ok"])
        answer["fix"] = ("a busy tenant is never stopped: wait for its work to finish and stop again; for a stop "
                         "that failed see its result's fix")
    elif not results:
        answer["note"] = "no tenant in tenants.json is started and stopped by the proxy: nothing to stop"
    return answer


def _sse(event: str, payload: object) -> bytes:
    """One server-sent event: its data one line of JSON (no newline can end it early)."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def release_answer(tenant: Tenant, result: ReleaseResult) -> JSONResponse:
    """200 when the card confirmed the memory back, or the engine's own report says so (estimated:
    no GPU reader); 504 when it was not back in time; 502 when the engine refused or was down."""
    body = ReleaseOutcome.of(result).dump()  # its tenant first
    if result.result in ("confirmed", "estimated"):
        return JSONResponse(body, status_code=200)
    body["fix"] = release_fix(tenant, result)
    return JSONResponse(body, status_code=504 if result.result == "timeout" else 502)


def release_fix(tenant: Tenant, result: ReleaseResult) -> str:
    """What to do about a release that failed (timeout: 504; refused or down: 502)."""
    if result.result == "timeout":
        seen = "the engine's own report" if result.estimated else "the card"
        return (f"{seen} still shows {tenant.name}'s memory: see what holds it (GET /api/tenants/{tenant.name}), "
                f"or give it longer (tenants.{tenant.name}.release_timeout_s)")
    if tenant.lifecycle is not None:
        return f"see why it did not stop (GET /api/tenants/{tenant.name}: lifecycle.error, its output), then stop again"
    return (f"check that {tenant.name} runs and answers at {tenant.upstream or 'its release URL'} "
            "(`hyperswap check`), then release again")


class AdminApi:
    def __init__(self, broker: GpuBroker, watchdog: Watchdog, adapter: Callable[[Tenant], SelfReport],
                 token: str | None = None, listeners: Mapping[str, str] | None = None,
                 closing: Callable[[], bool] | None = None) -> None:
        self.broker = broker
        self.adapter = adapter  # each tenant's engine adapter: where it runs (a release of a tenant on the CPU)
        # True once the admin server is told to stop: open streams (the logs) end, so the server's
        # shutdown never waits for them
        self.closing: Callable[[], bool] = closing or (lambda: False)
        self.watchdog = watchdog
        self.token = token
        # Where each tenant's listener really answers (a port of 0 in tenants.json is read back):
        # `hyperswap verify` reaches the engines through these.
        self.listeners = dict(listeners or {})

    # -- helpers ----------------------------------------------------------------------------
    def _guard(self, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            if self.token is not None:
                auth = request.headers.get("authorization", "")
                if not auth.lower().startswith("bearer "):
                    return error(401, "this admin call needs a bearer token",
                                 "send `Authorization: Bearer <token>` "
                                 "(the token from HYPERSWAP_ADMIN_TOKEN or admin.token_file)")
                if not hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()):
                    return error(403, "wrong admin token", "use the token the proxy was started with")
            return await handler(request)
        return wrapped

    @staticmethod
    def _safe(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except HyperSwapError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        return wrapped

    async def tenant_view(self, tenant: Tenant) -> JSONObject:
        snap = self.broker.last_snapshot or await self.broker.snapshot()
        state = self.broker.scheduler.states(snap)[tenant.name]
        return views.dump(views.tenant_view(self.broker, self.watchdog, snap, tenant, state,
                                            self.listeners.get(tenant.name)))

    # -- routes -------------------------------------------------------------------------------
    async def list_tenants(self, request: Request) -> Response:
        await self.broker.snapshot()
        return JSONResponse({"tenants": [await self.tenant_view(t) for t in self.broker.registry]})

    async def get_tenant(self, request: Request) -> Response:
        tenant = self.broker.registry.get(request.path_params["name"])
        await self.broker.snapshot()
        return JSONResponse(await self.tenant_view(tenant))

    async def release(self, request: Request) -> Response:
        tenant = self.broker.registry.get(request.path_params["name"])
        if not tenant.reclaimable:
            return refusals.not_reclaimable(tenant).response()
        snap = await self.broker.snapshot()
        state = self.broker.scheduler.states(snap)[tenant.name]
        if not state.busy and await self.adapter(tenant).runs_on_cpu(self.broker.control):
            return self._nothing_on_the_card(tenant)  # (busy first: a busy tenant's answer is 409 wherever it runs)
        if not state.busy:  # the release path checks again when its turn comes (another may be under way)
            order = release_whole(snap, tenant, "admin", "release", "asked by the admin API")
            (result,) = (await asyncio.shield(self.broker.scheduler.release(order))).results
            if not result.busy:
                return release_answer(tenant, result)
            state = self.broker.scheduler.states(await self.broker.snapshot())[tenant.name]
        return refusals.busy(tenant, state.busy_reason, "released").response()

    # -- tenants the proxy starts and stops --------------------------------------------------------
    def _lifecycle(self, tenant: Tenant, action: str) -> TenantLifecycle | Response:
        """The tenant's state machine, or the 409 for a tenant the proxy does not start and stop."""
        machine = self.broker.lifecycles.machine(tenant.name)
        if machine is not None:
            return machine
        return refusals.not_lifecycle(tenant, action).response()

    def _lifecycle_answer(self, tenant: Tenant, machine: TenantLifecycle, action: str,
                          status: int = 200, **fields: object) -> JSONResponse:
        return JSONResponse(self._lifecycle_body(tenant, machine, action, **fields), status_code=status)

    @staticmethod
    def _lifecycle_body(tenant: Tenant, machine: TenantLifecycle, action: str, **fields: object) -> dict[str, object]:
        return {"tenant": tenant.name, "action": action, "ok": True, **fields, "lifecycle": machine.view()}

    async def start(self, request: Request) -> Response:
        """Start a tenant the proxy starts: its memory planned exactly as for a request that wakes it
        (507 when impossible, 503 past the queue timeout), then started past any backoff."""
        tenant = self.broker.registry.get(request.path_params["name"])
        machine = self._lifecycle(tenant, "start")
        if isinstance(machine, Response):
            return machine
        if machine.state == "running":
            return self._lifecycle_answer(tenant, machine, "start", note=f"{tenant.name} runs already: nothing to do")
        outcome = await self.broker.starter.start(tenant, "admin start")
        if isinstance(outcome, Admitted):
            return self._start_not_admitted(tenant, machine, outcome)
        if outcome.ok:
            return self._lifecycle_answer(tenant, machine, "start", report=report_json.LifecycleReport.of(outcome).dump())
        return refusals.start_failed(outcome.error_for_client(), machine.view()).response()

    def _start_not_admitted(self, tenant: Tenant, machine: TenantLifecycle, admitted: Admitted) -> Response:
        """The queue refused the start's memory (507: impossible) or it waited past the queue timeout (503)."""
        handoff = admitted.handoff
        if admitted.outcome == "timeout":
            timeout_s = self.broker.registry.config.proxy.queue_timeout_s
            self.broker.decisions.emit(Rejected(tenant=tenant.name, trigger="admin start", plan=handoff.plan, status=503,
                                             reason=admitted.reason))
            return refusals.start_queue_timeout(tenant, admitted, timeout_s, machine.view()).response()
        return refusals.not_enough_memory(tenant, handoff, self.broker.starter.start_need(tenant).bytes).response()

    async def stop(self, request: Request) -> Response:
        """Stop an idle tenant the proxy starts, through the one release path (its stopping step)."""
        tenant = self.broker.registry.get(request.path_params["name"])
        machine = self._lifecycle(tenant, "stop")
        if isinstance(machine, Response):
            return machine
        status, body = await self._stop_one(tenant, machine, "admin stop")
        return JSONResponse(body, status_code=status)

    async def _stop_one(self, tenant: Tenant, machine: TenantLifecycle, trigger: str) -> tuple[int, Mapping[str, object]]:
        """The admin's stop of one tenant: (status, body) as `/api/tenants/{name}/stop` answers it."""
        if machine.state == "stopped":
            return 200, self._lifecycle_body(tenant, machine, "stop",
                                             note=f"{tenant.name} is stopped already: nothing to do")
        if machine.state == "starting":
            return 409, refusals.starting(tenant, machine.view()).body()
        snap = await self.broker.snapshot()
        state = self.broker.scheduler.states(snap)[tenant.name]
        if not state.busy and not self.broker.releases.stop_blocked(tenant.name):  # the release path checks again in its turn
            order = stop_whole(snap, tenant, trigger, f"stop asked by the admin API ({trigger})")
            (result,) = (await asyncio.shield(self.broker.scheduler.release(order))).results
            if result.result in ("confirmed", "estimated"):
                return 200, self._lifecycle_body(tenant, machine, "stop", release=ReleaseOutcome.of(result).dump())
            if not result.busy:
                return 504 if result.result == "timeout" else 502, refusal(
                    f"{tenant.name} could not be stopped: {result.error or result.result}",
                    release_fix(tenant, result), tenant=tenant.name, reason="stop_failed",
                    release=ReleaseOutcome.of(result).dump(), lifecycle=machine.view())
            state = self.broker.scheduler.states(await self.broker.snapshot())[tenant.name]
        why = state.busy_reason if state.busy else "a request, stream or websocket is open"
        return 409, refusals.busy(tenant, why, "stopped", machine.view()).body()

    async def stop_all(self, request: Request) -> Response:
        """Stop every tenant the proxy starts that is idle (llama-swap's unload-all), one after another
        through the same path as `/api/tenants/{name}/stop`; busy and starting ones are left running and
        named with why. 200 when all are stopped now, else 409 (a stop that failed, or one refused)."""
        answer = _stop_all_answer(await self._stop_each_idle())
        return JSONResponse(answer, status_code=200 if answer["ok"] else 409)

    async def _stop_each_idle(self) -> list[dict[str, object]]:
        """Each tenant the proxy starts, stopped in turn through `_stop_one`: its answer, named and with
        its status (the answer's `action` left out)."""
        results: list[dict[str, object]] = []
        for tenant in self.broker.registry:
            machine = self.broker.lifecycles.machine(tenant.name)
            if machine is None:
                continue
            status, body = await self._stop_one(tenant, machine, "admin stop all")
            results.append({**{k: v for k, v in body.items() if k != "action"}, "tenant": tenant.name,
                            "ok": status == 200, "status": status})
        return results

    async def logs(self, request: Request) -> Response:
        """The app's output as server-sent events: its last lines (`lines`, default 100), then each new
        line as it is written to its log file, until the client goes away or the proxy stops."""
        tenant = self.broker.registry.get(request.path_params["name"])
        machine = self._lifecycle(tenant, "stream the output of")
        if isinstance(machine, Response):
            return machine
        controller = machine.controller
        elsewhere = controller.output_elsewhere()
        if elsewhere is not None or not isinstance(controller, ProcessController):
            runs_as, where = elsewhere or (controller.kind, "its manager")
            return refusals.no_log(tenant, runs_as, where, machine.view()).response()
        back = integer(request.query_params, "lines", LINES_BACK_DEFAULT, low=0, high=LINES_BACK_MAX,
                       example=f"GET /api/tenants/{tenant.name}/logs?lines=100")
        follower = LogFollower(controller)
        if not follower.admit():
            return error(429, f"{MAX_FOLLOWERS} streams already follow {tenant.name}'s output",
                         f"close one, or read its log file ({controller.log_path or 'a temporary file'})")
        try:
            first = await follower.back(back)
        except BaseException:
            follower.close()
            raise
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(self._log_stream(follower, first), media_type="text/event-stream", headers=headers)

    async def _log_stream(self, follower: LogFollower, first: Chunk) -> AsyncIterator[bytes]:
        try:
            async for frame in self._log_frames(follower, first):
                yield frame
        finally:
            follower.close()

    async def _log_frames(self, follower: LogFollower, first: Chunk) -> AsyncIterator[bytes]:
        clock = self.broker.clock
        yield b"retry: 2000\n\n"
        chunk, quiet_s = first, 0.0
        while True:
            if chunk.new_run is not None:
                run = views.LogRun(run=chunk.new_run, note="the app was started again: its new output follows")
                yield _sse("run", views.dump(run))
            for line in chunk.lines:
                yield _sse("line", views.dump(views.LogLine(line=line)))
            if chunk.lines or chunk.new_run is not None:
                quiet_s = 0.0
            elif quiet_s >= LOG_KEEPALIVE_S:  # a comment line: keeps proxies in between from closing it
                yield b": still following\n\n"
                quiet_s = 0.0
            if self.closing():
                return
            await clock.sleep(FOLLOW_EVERY_S)
            quiet_s += FOLLOW_EVERY_S
            chunk = await follower.new()

    def _nothing_on_the_card(self, tenant: Tenant) -> Response:
        """A CPU engine holds no GPU memory: nothing is asked, and the answer says why."""
        note = (f"{tenant.name} runs on the CPU (its /system_stats device type is cpu): it holds no GPU memory, "
                "so there is nothing to release")
        self.broker.decisions.emit(NothingToRelease(tenant=tenant.name, trigger="admin", reason=note))
        body = {**ReleaseOutcome.of(ReleaseResult(tenant.name, 0, 0, 0.0, False)).dump(), "result": "not_on_gpu"}
        return JSONResponse({"tenant": tenant.name, **body, "reason": "cpu", "note": note})

    async def plan(self, request: Request) -> Response:
        name = request.query_params.get("tenant")
        if not name:
            return error(400, "missing query parameter 'tenant'", "GET /api/plan?tenant=ollama&need_gb=8")
        need_gb = optional_number(request.query_params, "need_gb", low=0, high=MAX_GIB,
                                  example="GiB, like GET /api/plan?tenant=ollama&need_gb=8")
        tenant = self.broker.registry.get(name)
        need = tenant.needs_vram_bytes if need_gb is None else int(need_gb * GIB)
        plan, _ = await self.broker.plan(name, need)
        return JSONResponse({"dry_run": True, "plan": plan_json(plan)})

    async def decisions(self, request: Request) -> Response:
        limit = integer(request.query_params, "limit", 100, low=1, high=500, example="GET /api/decisions?limit=100")
        recent = self.broker.decisions.recent(limit)
        return JSONResponse(views.DecisionList(decisions=[Decision.of(d) for d in recent]).dump())

    async def decision(self, request: Request) -> Response:
        """One decision, and the story of the request it belongs to (arrived, waited for whom, the
        releases, the load, the first byte), with the decisions it is told from."""
        raw = request.path_params["id"]
        if not raw.isdigit():
            return error(400, f"decision id {raw!r} is not a number", "GET /api/decisions/42 (ids from GET /api/decisions)")
        log = self.broker.decisions
        view = log.view(int(raw))
        if view is None:
            return error(404, f"no decision {raw} (too old, or never made)", "GET /api/decisions lists the kept ones")
        story = log.story(view.id)
        related = [v for i in (story.related if story else ()) if i != view.id and (v := log.view(i)) is not None]
        return JSONResponse(views.DecisionDetail(decision=Decision.of(view), story=RequestStory.of(story) if story else None,
                                                 related=[Decision.of(v) for v in related]).dump())

    async def stats(self, request: Request) -> Response:
        snap = await self.broker.snapshot()
        states = self.broker.scheduler.states(snap)
        stats = views.Stats(
            device=views.device_view(snap),
            processes=[views.card_process(p) for p in snap.processes],
            tenants=[views.tenant_view(self.broker, self.watchdog, snap, t, states[t.name], self.listeners.get(t.name))
                     for t in self.broker.registry],
            decisions=[Decision.of(d) for d in self.broker.decisions.recent(20)],
            gpu_error=views.gpu_error_view(self.broker.last_read_error),
        )
        return JSONResponse(views.dump(stats))

    async def not_found(self, request: Request) -> Response:
        return error(404, f"no admin route {request.method} {request.url.path}",
                     "see GET /api/tenants, /api/plan, /api/decisions")

    def app(self, extra_routes: list[BaseRoute] | None = None) -> Starlette:
        s = self._safe
        routes = [
            Route("/api/tenants", s(self.list_tenants), methods=["GET"]),
            Route("/api/tenants/stop", s(self._guard(self.stop_all)), methods=["POST"]),
            Route("/api/tenants/{name}", s(self.get_tenant), methods=["GET"]),
            Route("/api/tenants/{name}/logs", s(self.logs), methods=["GET"]),
            Route("/api/tenants/{name}/release", s(self._guard(self.release)), methods=["POST"]),
            Route("/api/tenants/{name}/start", s(self._guard(self.start)), methods=["POST"]),
            Route("/api/tenants/{name}/stop", s(self._guard(self.stop)), methods=["POST"]),
            Route("/api/plan", s(self.plan), methods=["GET"]),
            Route("/api/decisions", s(self.decisions), methods=["GET"]),
            Route("/api/decisions/{id}", s(self.decision), methods=["GET"]),
            Route("/api/stats", s(self.stats), methods=["GET"]),
            *(extra_routes or []),
        ]
        # No CORS unless configured: a web page on another origin must not drive the admin API.
        spec = self.broker.registry.config.admin
        cors = spec.cors_origins
        middleware = [Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type"])] if cors else []
        # Outermost: a rebinding page or a cross-site form is refused before CORS or any route sees it.
        hosts = listener_policy(spec.listen.rpartition(":")[0], spec.allowed_hosts)
        middleware.insert(0, Middleware(AdminGuard, hosts=hosts, cors_origins=cors))
        app = Starlette(routes=routes, middleware=middleware)

        async def not_found(request: Request, exc: Exception) -> Response:
            return await self.not_found(request)

        async def not_allowed(request: Request, exc: Exception) -> Response:
            allow = (getattr(exc, "headers", None) or {}).get("Allow", "")
            answer = error(405, f"{request.method} is not allowed on {request.url.path}",
                           f"use {allow} (GET /openapi.json lists every route)" if allow else None)
            answer.headers.update(getattr(exc, "headers", None) or {})  # Allow: what the route takes
            return answer

        app.add_exception_handler(404, not_found)
        app.add_exception_handler(405, not_allowed)
        return app
