"""The admin API (default 127.0.0.1:11400): tenants with live state, release, dry-run plans, decisions.

Read-mostly: the mutations (release, start, stop) take the scheduler's one release path, one at a time
with every other release.
When a token is configured every mutating call needs `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin import views
from proxy.admin.query import integer, optional_number
from proxy.errors import HyperSwapError
from proxy.handoff.arbitration import Arbitration, ReleaseResult
from proxy.handoff.decisions import NothingToRelease, Rejected
from proxy.handoff.scheduler import Admitted, release_whole, stop_whole
from proxy.handoff.watchdog import Watchdog
from proxy.hosts import listener_policy
from proxy.lifecycle.state import TenantLifecycle
from proxy.relay.gpu_gate import rejection_body, retry_after
from proxy.relay.guards import AdminGuard
from proxy.tenants import GIB, MAX_GIB, Tenant

Handler = Callable[[Request], Awaitable[Response]]


def error(status: int, message: str, fix: str | None = None, **details: Any) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if fix:
        body["fix"] = fix
    body.update(details)
    return JSONResponse(body, status_code=status)


def release_answer(tenant: Tenant, result: ReleaseResult) -> JSONResponse:
    """200 when the card confirmed the memory back, or the engine's own report says so (estimated:
    no GPU reader); 504 when it was not back in time; 502 when the engine refused or was down."""
    body: dict[str, Any] = {"tenant": tenant.name, **result.to_json()}
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
    def __init__(self, arb: Arbitration, watchdog: Watchdog, token: str | None = None,
                 listeners: Mapping[str, str] | None = None) -> None:
        self.arb = arb
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
                return JSONResponse(exc.to_json(), status_code=exc.status)
        return wrapped

    async def tenant_view(self, tenant: Tenant) -> dict[str, Any]:
        snap = self.arb.last_snapshot or await self.arb.snapshot()
        state = self.arb.scheduler.states(snap)[tenant.name]
        return views.dump(views.tenant_view(self.arb, self.watchdog, snap, tenant, state,
                                            self.listeners.get(tenant.name)))

    # -- routes -------------------------------------------------------------------------------
    async def list_tenants(self, request: Request) -> Response:
        await self.arb.snapshot()
        return JSONResponse({"tenants": [await self.tenant_view(t) for t in self.arb.registry]})

    async def get_tenant(self, request: Request) -> Response:
        tenant = self.arb.registry.get(request.path_params["name"])
        await self.arb.snapshot()
        return JSONResponse(await self.tenant_view(tenant))

    async def release(self, request: Request) -> Response:
        tenant = self.arb.registry.get(request.path_params["name"])
        if not tenant.reclaimable:
            return error(409, tenant.not_reclaimable_reason,
                         "this tenant cannot be released; stop it by hand if you need the memory",
                         tenant=tenant.name, reason="not_reclaimable")
        snap = await self.arb.snapshot()
        state = self.arb.scheduler.states(snap)[tenant.name]
        if not state.busy and await self.arb.adapter(tenant).runs_on_cpu(self.arb.control):
            return self._nothing_on_the_card(tenant)  # (busy first: a busy tenant's answer is 409 wherever it runs)
        if not state.busy:  # the release path checks again when its turn comes (another may be under way)
            order = release_whole(snap, tenant, "admin", "release", "asked by the admin API")
            (result,) = (await asyncio.shield(self.arb.scheduler.release(order))).results
            if not result.busy:
                return release_answer(tenant, result)
            state = self.arb.scheduler.states(await self.arb.snapshot())[tenant.name]
        return error(409, f"{tenant.name} is busy ({state.busy_reason}); a busy tenant is never released",
                     "wait for its work to finish, or cancel it in the application", tenant=tenant.name, reason="busy")

    # -- tenants the proxy starts and stops --------------------------------------------------------
    def _lifecycle(self, tenant: Tenant, action: str) -> TenantLifecycle | Response:
        """The tenant's state machine, or the 409 for a tenant the proxy does not start and stop."""
        machine = self.arb.lifecycles.machine(tenant.name)
        if machine is not None:
            return machine
        kinds = ", ".join(s.kind for s in tenant.release_steps) or "none"
        return error(409, f"{tenant.name} is not a tenant the proxy starts and stops (release kind {kinds}): "
                          f"it cannot {action} it",
                     "only a tenant whose release in tenants.json is of kind process, systemd or docker is started "
                     "and stopped by the proxy; start or stop this one yourself", tenant=tenant.name,
                     reason="not_lifecycle", lifecycle=None)

    def _lifecycle_answer(self, tenant: Tenant, machine: TenantLifecycle, action: str,
                          status: int = 200, **fields: Any) -> JSONResponse:
        body: dict[str, Any] = {"tenant": tenant.name, "action": action, "ok": True, **fields,
                                "lifecycle": machine.view()}
        return JSONResponse(body, status_code=status)

    async def start(self, request: Request) -> Response:
        """Start a tenant the proxy starts: its memory planned exactly as for a request that wakes it
        (507 when impossible, 503 past the queue timeout), then started past any backoff."""
        tenant = self.arb.registry.get(request.path_params["name"])
        machine = self._lifecycle(tenant, "start")
        if isinstance(machine, Response):
            return machine
        if machine.state == "running":
            return self._lifecycle_answer(tenant, machine, "start", note=f"{tenant.name} runs already: nothing to do")
        outcome = await self.arb.start(tenant, "admin start")
        if isinstance(outcome, Admitted):
            return self._start_not_admitted(tenant, machine, outcome)
        if outcome.ok:
            return self._lifecycle_answer(tenant, machine, "start", report=outcome.to_json())
        err = outcome.error_for_client()
        body = {**err.to_json(), "reason": "start_failed", "lifecycle": machine.view()}
        body.pop("state", None)
        return JSONResponse(body, status_code=503, headers={"Retry-After": retry_after(err)})

    def _start_not_admitted(self, tenant: Tenant, machine: TenantLifecycle, admitted: Admitted) -> Response:
        """The queue refused the start's memory (507: impossible) or it waited past the queue timeout (503)."""
        handoff = admitted.handoff
        if admitted.outcome == "timeout":
            timeout_s = self.arb.registry.config.proxy.queue_timeout_s
            self.arb.decisions.emit(Rejected(tenant=tenant.name, trigger="admin start", plan=handoff.plan, status=503,
                                             reason=admitted.reason))
            return JSONResponse(
                {"error": f"the start of {tenant.name} waited {timeout_s:g} s for GPU memory: {admitted.reason}",
                 "fix": "start it again once the busy tenants finish (Retry-After), or raise proxy.queue_timeout_s "
                        "in tenants.json",
                 "tenant": tenant.name, "reason": "queue_timeout", "waited_s": round(handoff.waited_s, 3),
                 "waiting_for": list(handoff.plan.wait_for), "lifecycle": machine.view()},
                status_code=503, headers={"Retry-After": str(max(1, int(min(timeout_s, 30))))})
        return JSONResponse(rejection_body(tenant, handoff, self.arb.start_need(tenant)), status_code=507)

    async def stop(self, request: Request) -> Response:
        """Stop an idle tenant the proxy starts, through the one release path (its stopping step)."""
        tenant = self.arb.registry.get(request.path_params["name"])
        machine = self._lifecycle(tenant, "stop")
        if isinstance(machine, Response):
            return machine
        if machine.state == "stopped":
            return self._lifecycle_answer(tenant, machine, "stop", note=f"{tenant.name} is stopped already: nothing to do")
        if machine.state == "starting":
            return error(409, f"{tenant.name} is starting: it is stopped only once it runs and is idle",
                         "wait for the start to end, then stop it", tenant=tenant.name, reason="starting",
                         lifecycle=machine.view())
        snap = await self.arb.snapshot()
        state = self.arb.scheduler.states(snap)[tenant.name]
        if not state.busy and not self.arb.stop_blocked(tenant.name):  # the release path checks again in its turn
            order = stop_whole(snap, tenant, "admin stop", "stop asked by the admin API")
            (result,) = (await asyncio.shield(self.arb.scheduler.release(order))).results
            if result.result in ("confirmed", "estimated"):
                return self._lifecycle_answer(tenant, machine, "stop", release=result.to_json())
            if not result.busy:
                return error(504 if result.result == "timeout" else 502,
                             f"{tenant.name} could not be stopped: {result.error or result.result}",
                             release_fix(tenant, result), tenant=tenant.name, reason="stop_failed",
                             release=result.to_json(), lifecycle=machine.view())
            state = self.arb.scheduler.states(await self.arb.snapshot())[tenant.name]
        why = state.busy_reason if state.busy else "a request, stream or websocket is open"
        return error(409, f"{tenant.name} is busy ({why}); a busy tenant is never stopped",
                     "wait for its work to finish, or cancel it in the application", tenant=tenant.name,
                     reason="busy", lifecycle=machine.view())

    def _nothing_on_the_card(self, tenant: Tenant) -> Response:
        """A CPU engine holds no GPU memory: nothing is asked, and the answer says why."""
        note = (f"{tenant.name} runs on the CPU (its /system_stats device type is cpu): it holds no GPU memory, "
                "so there is nothing to release")
        self.arb.decisions.emit(NothingToRelease(tenant=tenant.name, trigger="admin", reason=note))
        body = {**ReleaseResult(tenant.name, 0, 0, 0.0, False).to_json(), "result": "not_on_gpu"}
        return JSONResponse({"tenant": tenant.name, **body, "reason": "cpu", "note": note})

    async def plan(self, request: Request) -> Response:
        name = request.query_params.get("tenant")
        if not name:
            return error(400, "missing query parameter 'tenant'", "GET /api/plan?tenant=ollama&need_gb=8")
        need_gb = optional_number(request.query_params, "need_gb", low=0, high=MAX_GIB,
                                  example="GiB, like GET /api/plan?tenant=ollama&need_gb=8")
        tenant = self.arb.registry.get(name)
        need = tenant.needs_vram_bytes if need_gb is None else int(need_gb * GIB)
        plan, _ = await self.arb.plan(name, need)
        return JSONResponse({"dry_run": True, "plan": plan.to_json()})

    async def decisions(self, request: Request) -> Response:
        limit = integer(request.query_params, "limit", 100, low=1, high=500, example="GET /api/decisions?limit=100")
        return JSONResponse({"decisions": [d.to_json() for d in self.arb.decisions.recent(limit)]})

    async def decision(self, request: Request) -> Response:
        """One decision, and the story of the request it belongs to (arrived, waited for whom, the
        releases, the load, the first byte), with the decisions it is told from."""
        raw = request.path_params["id"]
        if not raw.isdigit():
            return error(400, f"decision id {raw!r} is not a number", "GET /api/decisions/42 (ids from GET /api/decisions)")
        log = self.arb.decisions
        view = log.view(int(raw))
        if view is None:
            return error(404, f"no decision {raw} (too old, or never made)", "GET /api/decisions lists the kept ones")
        story = log.story(view.id)
        related = [v for i in (story.related if story else ()) if i != view.id and (v := log.view(i)) is not None]
        return JSONResponse({"decision": view.to_json(), "story": story.to_json() if story else None,
                             "related": [v.to_json() for v in related]})

    async def stats(self, request: Request) -> Response:
        snap = await self.arb.snapshot()
        states = self.arb.scheduler.states(snap)
        stats = views.Stats(
            device=views.device_view(snap),
            processes=[views.card_process(p) for p in snap.processes],
            tenants=[views.tenant_view(self.arb, self.watchdog, snap, t, states[t.name], self.listeners.get(t.name))
                     for t in self.arb.registry],
            decisions=[views.Decision.model_validate(d.to_json()) for d in self.arb.decisions.recent(20)],
            gpu_error=views.gpu_error_view(self.arb.last_read_error),
        )
        return JSONResponse(views.dump(stats))

    async def not_found(self, request: Request) -> Response:
        return error(404, f"no admin route {request.method} {request.url.path}",
                     "see GET /api/tenants, /api/plan, /api/decisions")

    def app(self, extra_routes: list[BaseRoute] | None = None) -> Starlette:
        s = self._safe
        routes = [
            Route("/api/tenants", s(self.list_tenants), methods=["GET"]),
            Route("/api/tenants/{name}", s(self.get_tenant), methods=["GET"]),
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
        spec = self.arb.registry.config.admin
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
