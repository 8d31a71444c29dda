"""GET /openapi.json: an OpenAPI 3.1 document of the admin API.

Bodies are the pydantic models of `proxy.admin.views` (the same ones the handlers build their
answers with), turned into JSON Schema by pydantic. The served document lists the routes actually mounted on the admin app, so
it never promises one that is not there; a mounted route with no operation below shows up marked
`x-undocumented` (the tests fail on that, so a new route gets its entry here).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import TypedDict, cast

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.health_report import HealthReport
from proxy.admin.proxy_view import ProxyView
from proxy.admin.telemetry import HISTORY_LIMIT_MAX
from proxy.admin.telemetry_rows import KINDS
from proxy.admin.views import (
    CatalogFrame,
    DecisionDetail,
    DecisionList,
    DryRun,
    EngineList,
    Error,
    LifecycleAnswer,
    LifecycleFrame,
    LifecycleRefusal,
    LogLine,
    LogRun,
    Rejection,
    ReleaseResult,
    Stats,
    StatsFrame,
    StopAllAnswer,
    TenantList,
    TenantView,
)
from proxy.config.bounds import MAX_GIB

JSON = dict[str, object]  # a piece of the OpenAPI document
REF = "#/components/schemas/{model}"

MODELS: tuple[type[BaseModel], ...] = (Error, DryRun, Rejection, ReleaseResult, TenantList, TenantView, DecisionList,
                                       DecisionDetail,
                                       Stats, StatsFrame, CatalogFrame, HealthReport, EngineList, LifecycleAnswer,
                                       LifecycleRefusal, LifecycleFrame, StopAllAnswer, LogLine, LogRun)


def _ref(model: type[BaseModel]) -> JSON:
    return {"$ref": REF.format(model=model.__name__)}


def _json(description: str, schema: JSON | type[BaseModel]) -> JSON:
    s = _ref(schema) if isinstance(schema, type) else schema
    return {"description": description, "content": {"application/json": {"schema": s}}}


def _err(description: str) -> JSON:
    return _json(description, Error)


ANY_OBJECT: JSON = {"type": "object", "additionalProperties": True}
NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "tenant name"}


MODEL_BODY: JSON = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["tenant", "model"], "additionalProperties": False,
    "properties": {"tenant": {"type": "string", "minLength": 1}, "model": {"type": "string", "minLength": 1}}}}}}


def _operations() -> dict[str, dict[str, JSON]]:
    return {
        "/api/tenants": {"get": {
            "summary": "Every tenant with its live state", "operationId": "listTenants",
            "responses": {"200": _json("tenants", TenantList)}}},
        "/api/tenants/{name}": {"get": {
            "summary": "One tenant with its live state", "operationId": "getTenant", "parameters": [NAME],
            "responses": {"200": _json("the tenant", TenantView), "404": _err("no such tenant")}}},
        "/api/tenants/{name}/release": {"post": {
            "summary": "Release an idle tenant's GPU memory now", "operationId": "releaseTenant",
            "description": ("Takes the scheduler's one release path, one release at a time. Done when the GPU shows the "
                            "memory back (confirmed), or without a GPU reader when the engine's own report says so (estimated)."),
            "parameters": [NAME], "security": [{"bearer": []}],
            "responses": {
                "200": _json("released: confirmed on the GPU, or estimated from the engine's own report (no GPU "
                             "reader); or nothing to release (reason cpu: the engine runs on the CPU)", ReleaseResult),
                "401": _err("a token is configured and none was sent"),
                "404": _err("no such tenant"),
                "409": _err("busy, or the tenant has no release strategy (reason says which)"),
                "502": _json("the engine refused or failed the release (error, fix)", ReleaseResult),
                "504": _json("the memory was not back before the tenant's release_timeout_s (error, fix)",
                             ReleaseResult)}}},
        "/api/tenants/{name}/start": {"post": {
            "summary": "Start a tenant the proxy starts and stops (release kind process, systemd or docker)",
            "operationId": "startTenant",
            "description": ("Its memory is planned exactly as for a request that wakes it (idle tenants released, busy "
                            "ones waited for), then it is started and its readiness awaited; a start under way is "
                            "shared, and the backoff after a failed start is skipped (an explicit ask)."),
            "parameters": [NAME], "security": [{"bearer": []}],
            "responses": {
                "200": _json("running: started now (report), or already (note)", LifecycleAnswer),
                "401": _err("a token is configured and none was sent"),
                "404": _err("no such tenant"),
                "409": _json("not a tenant the proxy starts and stops (reason not_lifecycle)", LifecycleRefusal),
                "503": _json("the start failed or timed out (reason start_failed: error, fix, the app's last output "
                             "lines, Retry-After), or waited past proxy.queue_timeout_s for memory (reason "
                             "queue_timeout)", LifecycleRefusal),
                "507": _json("not enough GPU memory for the start even once every busy tenant finished", Rejection)}}},
        "/api/tenants/{name}/stop": {"post": {
            "summary": "Stop an idle tenant the proxy starts and stops", "operationId": "stopTenant",
            "description": ("Through the one release path (recorded as a release decision, in the handoff queue's "
                            "turn) with the tenant's stopping step alone. A busy tenant is never stopped."),
            "parameters": [NAME], "security": [{"bearer": []}],
            "responses": {
                "200": _json("stopped (release: confirmed on the GPU, or estimated without a GPU reader), or "
                             "already (note)", LifecycleAnswer),
                "401": _err("a token is configured and none was sent"),
                "404": _err("no such tenant"),
                "409": _json("busy, starting, or not a tenant the proxy starts and stops (reason says which)",
                             LifecycleRefusal),
                "502": _json("the stop failed (reason stop_failed: error, fix, the release)", LifecycleRefusal),
                "504": _json("stopped, but its memory was not back before release_timeout_s", LifecycleRefusal)}}},
        "/api/tenants/stop": {"post": {
            "summary": "Stop every idle tenant the proxy starts and stops (unload everything)", "operationId": "stopAll",
            "description": ("Each tenant the proxy starts, one after another, exactly as POST /api/tenants/{name}/stop "
                            "does (the one release path, its stopping step alone). A busy or starting tenant is left "
                            "running and named with why; a stopped one needs nothing. Each tenant's result is in "
                            "`results`."),
            "security": [{"bearer": []}],
            "responses": {
                "200": _json("every tenant the proxy starts is stopped now (results: each one's)", StopAllAnswer),
                "401": _err("a token is configured and none was sent"),
                "409": _json("some were not stopped: busy or starting (refused), or their stop failed (failed); the "
                             "others were stopped", StopAllAnswer)}}},
        "/api/tenants/{name}/logs": {"get": {
            "summary": "The output of an app the proxy runs (release kind process), as server-sent events",
            "operationId": "tenantLogs",
            "description": ("text/event-stream: its last `lines` lines, then each new line as the app writes it to "
                            "its log file (in the state directory), for as long as the client stays. `event: line` "
                            "carries a LogLine; `event: run` (a LogRun) says the app was started again and the lines "
                            "after it are the new run's; a comment line comes every 15 s of quiet."),
            "parameters": [NAME, {"name": "lines", "in": "query", "required": False,
                                  "schema": {"type": "integer", "minimum": 0, "maximum": 1000, "default": 100},
                                  "description": "how many of the last lines to send first"}],
            "responses": {
                "200": {"description": "the stream", "content": {"text/event-stream": {
                    "schema": {"type": "string"}, "x-event-data": {"line": _ref(LogLine), "run": _ref(LogRun)}}}},
                "400": _err("lines is not an integer from 0 to 1000"),
                "404": _err("no such tenant"),
                "429": _err("4 streams already follow this tenant's output (MAX_FOLLOWERS): close one"),
                "409": _json("not a tenant the proxy runs (reason not_lifecycle), or one whose output its manager "
                             "keeps (reason no_log: a systemd unit or a container)", LifecycleRefusal)}}},
        "/api/plan": {"get": {
            "summary": "Dry-run plan: what would be released for a tenant to get need_gb", "operationId": "plan",
            "parameters": [
                {"name": "tenant", "in": "query", "required": True, "schema": {"type": "string"}},
                {"name": "need_gb", "in": "query", "required": False,
                 "schema": {"type": "number", "minimum": 0, "maximum": MAX_GIB},
                 "description": "GiB; default: the tenant's needs_vram_gb"}],
            "responses": {"200": _json("the plan; nothing is executed", DryRun),
                          "400": _err("missing tenant, or need_gb not a finite number in range"),
                          "404": _err("no such tenant")}}},
        "/api/decisions": {"get": {
            "summary": "Recent decisions (plans, releases, rejections, retries), oldest first", "operationId": "decisions",
            "parameters": [{"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 500, "default": 100}}],
            "responses": {"200": _json("decisions", DecisionList), "400": _err("limit is not an integer from 1 to 500")}}},
        "/api/decisions/{id}": {"get": {
            "summary": "One decision and the story of the request it belongs to: arrived, waited for whom, the "
                       "releases and how long each took, the load, the first byte", "operationId": "decision",
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0},
                            "description": "a decision id (GET /api/decisions)"}],
            "responses": {"200": _json("the decision and its request's story", DecisionDetail),
                          "400": _err("the id is not a number"), "404": _err("no such decision kept")}}},
        "/api/stats": {"get": {
            "summary": "Device, processes, tenants and recent decisions in one call", "operationId": "stats",
            "responses": {"200": _json("stats", Stats)}}},
        "/api/events": {"get": {
            "summary": "Server-sent events: catalog (first, then on change), stats (1/s), decision (each), "
                       "lifecycle (each state change of a tenant the proxy starts)",
            "operationId": "events",
            "description": ("text/event-stream. Every frame has `id:`; the stream starts with `retry:`. Send "
                            "`Last-Event-ID` on reconnect to get the decisions missed. `data:` is JSON: "
                            "StatsFrame, CatalogFrame, Decision or LifecycleFrame."),
            "parameters": [{"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer"}}],
            "responses": {"200": {"description": "the stream", "content": {"text/event-stream": {
                "schema": {"type": "string"},
                "x-event-data": {"stats": _ref(StatsFrame), "catalog": _ref(CatalogFrame),
                                 "decision": {"$ref": REF.format(model="Decision")},
                                 "lifecycle": _ref(LifecycleFrame)}}}}}}},
        "/api/health": {"get": {
            "summary": "Self-check: GPU reader, engines, config, and what works without a GPU reader",
            "operationId": "health",
            "responses": {"200": _json("always 200: each check says ok, degraded, failed or unknown (cannot run), with "
                                       "its fix", HealthReport)}}},
        "/api/engines": {"get": {
            "summary": "Each tenant's engine: reachable, version, what it reports about itself", "operationId": "engines",
            "responses": {"200": _json("engines", EngineList)}}},
        "/api/history": {"get": {
            "summary": "Stored history (telemetry) of memory, tenants and decisions", "operationId": "history",
            "parameters": [
                {"name": "since", "in": "query", "required": False, "schema": {"type": "number", "minimum": 0},
                 "description": "unix seconds; rows at or after it (default 0: all kept)"},
                {"name": "kind", "in": "query", "required": False, "schema": {"type": "string"},
                 "description": f"comma-separated, of: {', '.join(KINDS)} (default: all)"},
                {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": HISTORY_LIMIT_MAX, "default": 1000},
                 "description": "rows per kind, the newest"}],
            "responses": {"200": _json("history", ANY_OBJECT),
                          "400": _err("since not finite unix seconds, limit out of range, or an unknown kind"),
                          "503": _err("telemetry is off")}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics", "operationId": "metrics",
            "responses": {"200": {"description": "Prometheus text exposition format",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/": {"get": {
            "summary": "The dashboard (HTML page; live over /api/events)", "operationId": "dashboard",
            "responses": {"200": {"description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}},
                          "503": _err("the dashboard's files are not installed")}}},
        "/static/{path}": {"get": {
            "summary": "The dashboard's static files (app.js, app.css)", "operationId": "dashboardStatic",
            "parameters": [{"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the file", "content": {"text/javascript": {"schema": {"type": "string"}},
                                                                     "text/css": {"schema": {"type": "string"}}}},
                          "404": _err("no such dashboard file")}}},
        "/mcp": {method: {
            "summary": f"MCP tools over streamable HTTP ({method.upper()})", "operationId": f"mcp{method.capitalize()}",
            "description": ("Model Context Protocol endpoint (stateless, JSON answers): tools health, engines, "
                            "tenants, models, plan (dry run), release, start and stop, each a call to this API. "
                            "POST carries JSON-RPC; when a token is configured every call needs it."),
            "security": [{"bearer": []}],
            "responses": {"200": _json("a JSON-RPC answer", ANY_OBJECT), "401": _err("a token is configured and none was sent"),
                          "403": _err("wrong token" + ("" if method == "get" else ", or an Origin other than this "
                                                       "admin's own or admin.cors_origins")),
                          "501": _err("the optional mcp package is not installed (pip install 'mcp>=2.3,<3')")}}
                for method in ("get", "post", "delete")},
        "/api/models": {"get": {
            "summary": "Each tenant's model files with size and page-cache residency", "operationId": "models",
            "description": ("Residency is measured (cachestat, else mmap + mincore); a file the proxy may not read is "
                            "null with unknown_reason, never 0. Readings are kept a few seconds and dropped by a warm."),
            "parameters": [{"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}}],
            "responses": {"200": _json("models per tenant, MemAvailable, the warm margin and warms in progress", ANY_OBJECT),
                          "404": _err("no such tenant")}}},
        "/api/models/warm": {"post": {
            "summary": "Read a model's files into the page cache (stops at proxy.warm_margin_gb)", "operationId": "warmModel",
            "security": [{"bearer": []}], "requestBody": MODEL_BODY,
            "responses": {"202": _json("the warm started (or the one already running)", ANY_OBJECT),
                          "400": _err("the body is not {tenant, model}"), "401": _err("a token is configured and none was sent"),
                          "404": _err("no such tenant, or no such model on disk"),
                          "409": _err("MemAvailable is already at or below the margin, or cannot be read")}}},
        "/api/models/stop": {"post": {
            "summary": "Stop a warm in progress", "operationId": "stopWarm",
            "security": [{"bearer": []}], "requestBody": MODEL_BODY,
            "responses": {"200": _json("the warm, stopped", ANY_OBJECT),
                          "400": _err("the body is not {tenant, model}"), "401": _err("a token is configured and none was sent"),
                          "404": _err("no such tenant, or no such model on disk"),
                          "409": _err("no warm of that model is in progress")}}},
        "/api/models/loads": {"get": {
            "summary": "Recent model loads: bytes, seconds, GB/s, residency before, warm or cold", "operationId": "modelLoads",
            "responses": {"200": _json("loads and the warm/cold thresholds measured on this machine", ANY_OBJECT)}}},
        "/api/gpu": {"get": {
            "summary": "The GPU's own settings per device, and gpu_profile against them", "operationId": "gpu",
            "description": ("Power limit, clocks, clock offsets, fans, persistence mode, temperature and clock event "
                            "reasons, read through NVML (or the simulated card). A null field is unknown, never 0: "
                            "settings.unavailable says why (not supported, no permission). With a gpu_profile, the "
                            "profile's device carries one check per setting (ok, drift, unsupported, unreadable). "
                            "host_ram: what tenants with a cuda_suspend step have parked in host RAM, per tenant and "
                            "in all, and the host RAM still available (null: unknown)."),
            "responses": {"200": _json("the settings", {
                "type": "object", "required": ["devices", "profile", "apply"],
                "properties": {"devices": {"type": "array", "items": ANY_OBJECT},
                               "profile": {"anyOf": [ANY_OBJECT, {"type": "null"}]},
                               "apply": {"anyOf": [ANY_OBJECT, {"type": "null"}]},
                               "host_ram": ANY_OBJECT}})}}},
        "/openapi.json": {"get": {
            "summary": "This document", "operationId": "openapi",
            "responses": {"200": _json("OpenAPI 3.1", ANY_OBJECT)}}},
    }


def _schemas() -> JSON:
    """A copy per document (callers may change theirs) of schemas generated once: the models are
    fixed, and generating them took 0.2-0.7 s per /openapi.json here."""
    return copy.deepcopy(_generated_schemas())


@functools.cache
def _generated_schemas() -> JSON:
    _, top = models_json_schema([(m, "serialization") for m in MODELS], ref_template=REF)
    return dict(sorted(top.get("$defs", {}).items()))


def _without_auth(ops: dict[str, dict[str, JSON]]) -> None:
    """No token configured: nothing needs Authorization, and nothing answers 401 or 403 for a token
    (a mutation's 403 for a foreign Origin stays: `_guard_answers`)."""
    for methods in ops.values():
        for op in methods.values():
            if op.pop("security", None) is not None:
                for status in ("401", "403"):
                    responses_of(op).pop(status, None)


def responses_of(op: JSON) -> JSON:
    """An operation's responses, made when it has none (every operation here writes them as an object)."""
    return cast(JSON, op.setdefault("responses", {}))


def _guard_answers(method: str, op: JSON) -> None:
    """What the admin listener's guard answers before any route runs (proxy/guards.py): 421 to a
    foreign Host on every call; 403 to a foreign Origin and 415 to a non-JSON body on a mutation."""
    responses = responses_of(op)
    responses.setdefault("421", _err("a Host that is not this admin listener's address (loopback, its listen "
                                     "address, or admin.allowed_hosts)"))
    if method in ("get", "head"):
        return
    origin = "an Origin other than this admin's own or admin.cors_origins"
    responses.setdefault("403", _err(f"wrong token, or {origin}" if "security" in op else origin))
    responses.setdefault("415", _err("a body that is not JSON (send none, or Content-Type: application/json)"))


class Document(TypedDict):
    """The OpenAPI document: its routes (path -> method -> operation) and the schemas they refer to."""
    openapi: str
    info: JSON
    servers: list[JSON]
    paths: dict[str, dict[str, JSON]]
    components: JSON


def openapi_document(mounted: Iterable[tuple[str, str]] | None = None, *, token: bool = True) -> Document:
    """The document. `mounted`: (path, lower-case method) pairs actually served; None: every known one.
    `token`: whether the proxy runs with an admin token (only then do guarded calls need it)."""
    ops = _operations()
    if not token:
        _without_auth(ops)
    if mounted is None:
        paths = ops
    else:
        paths = {}
        for path, method in sorted(mounted):
            op = ops.get(path, {}).get(method)
            if op is None:
                op = {"summary": f"{method.upper()} {path}", "x-undocumented": True,
                      "responses": {"default": {"description": "not described yet"}}}
            paths.setdefault(path, {})[method] = op
    for path, methods in paths.items():
        for method, op in methods.items():
            if "{name}" in path:
                responses_of(op).setdefault("404", _err("no such tenant"))
            if not op.get("x-undocumented"):
                _guard_answers(method, op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "HyperSwap admin API", "version": "1",
                 "description": "Tenants sharing one GPU: live state, dry-run plans, releases, decisions, events."},
        "servers": [{"url": "http://127.0.0.1:11400"}],
        "paths": copy.deepcopy(paths),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "the token from HYPERSWAP_ADMIN_TOKEN or admin.token_file; "
                                                          "needed only when one is configured"}},
        },
    }


def routes_of(app_routes: Iterable[BaseRoute]) -> list[tuple[str, str]]:
    """(path, method) of each plain route; HEAD goes with GET and is not listed."""
    out: list[tuple[str, str]] = []
    for route in app_routes:
        if isinstance(route, Route):
            out += [(route.path, m.lower()) for m in sorted(route.methods or ()) if m != "HEAD"]
    return out


class OpenApiExtension:
    def __init__(self, proxy: ProxyView) -> None:
        self.proxy = proxy

    def routes(self) -> list[BaseRoute]:
        return [Route("/openapi.json", self.document, methods=["GET"])]

    async def document(self, request: Request) -> Response:
        doc = openapi_document(routes_of(request.app.routes), token=self.proxy.token is not None)
        host = request.headers.get("host")
        if host:
            doc["servers"] = [{"url": f"{request.url.scheme}://{host}"}]
        return JSONResponse(doc)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
