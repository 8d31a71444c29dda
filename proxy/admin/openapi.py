"""GET /openapi.json: an OpenAPI 3.1 document of the admin API.

Bodies are pydantic models here (documentation only: the handlers build plain dicts), turned into
JSON Schema by pydantic. The served document lists the routes actually mounted on the admin app, so
it never promises one that is not there; a mounted route with no operation below shows up marked
`x-undocumented` (the tests fail on that, so a new route gets its entry here).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.telemetry import HISTORY_LIMIT_MAX, KINDS
from proxy.tenants import MAX_GIB

if TYPE_CHECKING:
    from proxy.service import Proxy

JSON = dict[str, Any]
REF = "#/components/schemas/{model}"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class Error(_Doc):
    """Every error answer: a sentence, and a hint where one helps. Extra keys give details."""
    error: str
    fix: str | None = Field(default=None, description="what to do about it")
    tenant: str | None = None
    reason: str | None = Field(default=None, description="machine-readable, e.g. busy, not_reclaimable")


class Release(_Doc):
    tenant: str
    expected_free_bytes: int
    expected_free_gib: float | None
    pids: list[int]
    reason: str


class Blocker(_Doc):
    pid: int | None
    name: str
    tenant: str
    vram_bytes: int | None
    vram_gib: float | None = None
    reason: str = Field(description="why it could not be released: busy, not_reclaimable, priority, unmanaged, ...")
    detail: str


class Plan(_Doc):
    """A release plan as computed by the arbiter (logged before it runs)."""
    requester: str
    need_bytes: int
    need_gib: float | None
    free_bytes: int | None = Field(description="null when unplanned: nothing was measured")
    free_gib: float | None
    held_by_requester_bytes: int | None
    held_by_requester_gib: float | None
    promised_bytes: int = Field(default=0, description="free memory already promised to admitted loads still on their way")
    reachable_bytes: int | None = Field(default=0, description="free + held + every reclaimable tenant's memory, busy "
                                                                 "or idle; null when unplanned")
    feasible: bool = Field(description="enough now, with the releases listed")
    possible: bool = Field(default=True, description="enough once the busy tenants in wait_for finish; false: 507")
    outcome: Literal["ready", "release", "wait", "impossible", "unplanned"] | None = Field(
        default=None, description="unplanned: the card's size is unknown (no GPU reader, no engine reports the "
                                  "device), so the request is forwarded without a plan; the explanation says why")
    wait_for: list[str] = Field(default_factory=list, description="busy tenants the request waits for")
    starved: bool = Field(description="free + already held is below the need (only then is anything released)")
    estimated: bool = Field(description="memory figures are the engines' own reports (GPU reader failed)")
    releases: list[Release]
    blockers: list[Blocker]
    explanation: str
    device: PlanDevice | None = Field(default=None, description="only on a host with several GPUs: the card planned on")


class PlanDevice(_Doc):
    index: int = Field(description="NVML index (`nvidia-smi -L`)")
    name: str
    uuid: str | None = Field(default=None, description="in a 507's `device`")


class DryRun(_Doc):
    dry_run: Literal[True]
    plan: Plan


class RejectionBlocker(_Doc):
    pid: int | None
    name: str
    cmdline: str
    tenant: str
    vram_gb: float | None
    reason: str
    detail: str


class Rejection(_Doc):
    """The 507 a tenant's listener answers when no plan frees enough memory."""
    error: str
    tenant: str
    need_gb: float | None
    available_gb: float | None
    blockers: list[RejectionBlocker]
    plan: Plan
    fix: str
    device: PlanDevice | None = Field(default=None, description="only on a host with several GPUs: the card that "
                                                                "has not enough memory (another may have room)")


class ReleaseResult(_Doc):
    tenant: str
    expected_bytes: int
    freed_bytes: int = Field(description="as measured on the GPU; when estimated, as the engine's own report says")
    expected_gb: float | None
    freed_gb: float | None
    duration_s: float
    confirmed: bool = Field(description="the card showed the memory back")
    estimated: bool = Field(default=False, description="no GPU reader: judged from the engine's own report (Ollama's "
                                                       "/api/ps, ComfyUI's /system_stats), which may say so before "
                                                       "the memory is back; never confirmed")
    error: str | None
    asked: JSON = Field(description="what the engine was asked and answered")
    fix: str | None = Field(default=None, description="on 502 and 504: what to do about it")
    reason: Literal["cpu"] | None = Field(default=None, description="cpu: the engine runs on the CPU and holds no GPU "
                                                                    "memory; nothing was asked")
    note: str | None = None


class Process(_Doc):
    pid: int
    name: str
    cmdline: str | None = None
    tenant: str | None = None
    vram_bytes: int | None
    vram_gb: float | None = None


class Waiting(_Doc):
    """A request waiting in the handoff queue for GPU memory."""
    id: int
    tenant: str
    trigger: str
    since: float = Field(description="unix seconds")
    waited_s: float
    need_bytes: int
    need_gb: float | None
    priority: int
    waiting_for: list[str] = Field(description="busy tenants it waits for")
    behind: int | None = Field(description="the waiting request it queues behind, if any")
    reason: str


class _TenantLive(_Doc):
    """The live state both /api/tenants and the events' stats frames carry."""
    name: str
    vram_bytes: int | None = Field(description="null when nobody could see it (no GPU reader and no report of its own)")
    vram_gb: float | None
    busy: bool
    busy_reason: str
    in_flight: int
    jobs: list[str]
    stale_jobs: list[str]
    last_activity_age_s: float | None
    idle_release_in_s: float | None = Field(description="seconds until the idle release; null: never")
    reclaimable: bool
    waiting: list[Waiting] = Field(default_factory=list, description="this tenant's requests waiting for memory")


class CardHolding(_Doc):
    index: int
    name: str
    vram_bytes: int


class TenantDevices(_Doc):
    """Only on a host with several GPUs: the cards the tenant's engine loads on, and why."""
    devices: list[int] | None = Field(description="NVML indices; null: any device")
    source: Literal["pinned", "discovered", "any"] = Field(
        description="pinned: `devices` in tenants.json; discovered: its process's --cuda-device or CUDA_VISIBLE_DEVICES")
    detail: str
    vram_by_device: list[CardHolding]


class TenantView(_TenantLive):
    devices: TenantDevices | None = Field(default=None, description="only on a host with several GPUs")
    config: JSON
    processes: list[Process]
    watchdog: str | None
    estimated: bool
    listening: str | None = Field(default=None, description="the URL the tenant's listener answers at; null: no listener")


class TenantList(_Doc):
    tenants: list[TenantView]


class Decision(_Doc):
    id: int
    at: float = Field(description="unix seconds")
    kind: Literal["plan", "queued", "release", "rejection", "oom_retry", "idle_release", "spill", "stale_job"]
    tenant: str
    trigger: str
    plan: Plan | None
    outcome: JSON


class DecisionList(_Doc):
    decisions: list[Decision]


class Device(_Doc):
    """Unknown is not zero: a figure nobody measured is null (without a GPU reader: used, free and
    reserved; the total too when no engine reports the card)."""
    name: str
    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None
    reserved_bytes: int | None
    source: str = Field(description="nvml, simulated, or engine-estimate")
    notes: list[str]
    devices: list[Card] | None = Field(default=None, description="only on a host with several GPUs: each card (the "
                                                                 "figures above are then the whole host's sums)")


class Card(_Doc):
    index: int
    name: str
    uuid: str
    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None
    reserved_bytes: int | None
    tenants: dict[str, int] = Field(description="bytes each tenant (and `unmanaged`) holds on this card")
    placed: list[str] = Field(description="tenants pinned to or discovered on this card")


class GpuError(_Doc):
    state: str
    error: str
    fix: str


class Stats(_Doc):
    device: Device
    processes: list[Process]
    tenants: list[TenantView]
    decisions: list[Decision]
    gpu_error: GpuError | None


class StatsTenant(_TenantLive):
    engine: str
    priority: int
    pids: list[int]


class StatsFrame(_Doc):
    """`data:` of an `event: stats` frame on /api/events (one a second)."""
    device: Device
    tenants: list[StatsTenant]
    processes: list[Process]
    in_flight: int
    busy: list[str]
    decision_ids: list[int]
    handoff_in_progress: bool
    queue: list[Waiting] = Field(default_factory=list, description="every request waiting for memory, in arrival order")
    gpu_error: GpuError | None


class CatalogModel(_Doc):
    name: str
    size_bytes: int | None = Field(description="Ollama's size on disk; null for ComfyUI checkpoints")


class TenantCatalog(_Doc):
    engine: str
    models: list[CatalogModel]
    error: str | None = None


class CatalogFrame(_Doc):
    """`data:` of an `event: catalog` frame: sent first, then only when it changes."""
    tenants: dict[str, TenantCatalog]


class HealthEntry(_Doc):
    name: str
    status: Literal["ok", "degraded", "failed", "unknown"] = Field(
        description="unknown: the check cannot run (what it looks at cannot be seen); problem says why")
    problem: str | None
    impact: str | None
    fix: str | None


class Capability(_Doc):
    name: Literal["forwarding", "in-flight tracking", "arbitration", "confirmed releases"]
    status: Literal["ok", "estimated", "off"] = Field(description="estimated: on the engines' own reports")
    detail: str


class HealthReport(_Doc):
    status: Literal["ok", "degraded", "failed"] = Field(description="the worst entry's (unknown counts as degraded)")
    entries: list[HealthEntry]
    capabilities: list[Capability] = Field(description="what works now: without a GPU reader, forwarding and in-flight "
                                                       "tracking do; arbitration is estimated or off; releases are not "
                                                       "confirmed")
    checked_at: float | None = Field(default=None, description="unix seconds")


MODELS: tuple[type[BaseModel], ...] = (Error, DryRun, Rejection, ReleaseResult, TenantList, TenantView, DecisionList,
                                       Stats, StatsFrame, CatalogFrame, HealthReport)


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
            "description": ("Goes through the same handoff lock as requests. Done when the GPU shows the memory back "
                            "(confirmed), or without a GPU reader when the engine's own report says so (estimated)."),
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
        "/api/stats": {"get": {
            "summary": "Device, processes, tenants and recent decisions in one call", "operationId": "stats",
            "responses": {"200": _json("stats", Stats)}}},
        "/api/events": {"get": {
            "summary": "Server-sent events: catalog (first, then on change), stats (1/s), decision (each)",
            "operationId": "events",
            "description": ("text/event-stream. Every frame has `id:`; the stream starts with `retry:`. Send "
                            "`Last-Event-ID` on reconnect to get the decisions missed. `data:` is JSON: "
                            "StatsFrame, CatalogFrame or Decision."),
            "parameters": [{"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer"}}],
            "responses": {"200": {"description": "the stream", "content": {"text/event-stream": {
                "schema": {"type": "string"},
                "x-event-data": {"stats": _ref(StatsFrame), "catalog": _ref(CatalogFrame),
                                 "decision": {"$ref": REF.format(model="Decision")}}}}}}}},
        "/api/health": {"get": {
            "summary": "Self-check: GPU reader, engines, config, and what works without a GPU reader",
            "operationId": "health",
            "responses": {"200": _json("always 200: each check says ok, degraded, failed or unknown (cannot run), with "
                                       "its fix", HealthReport)}}},
        "/api/engines": {"get": {
            "summary": "Each tenant's engine: reachable, version, what it reports about itself", "operationId": "engines",
            "responses": {"200": _json("engines", {"type": "object", "required": ["engines"],
                                                   "properties": {"engines": {"type": "array", "items": ANY_OBJECT}}})}}},
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
                            "tenants, models, plan (dry run) and release, each a call to this API. POST carries JSON-RPC; "
                            "when a token is configured every call needs it."),
            "security": [{"bearer": []}],
            "responses": {"200": _json("a JSON-RPC answer", ANY_OBJECT), "401": _err("a token is configured and none was sent"),
                          "403": _err("wrong token" + ("" if method == "get" else ", or an Origin other than this "
                                                       "admin's own or admin.cors_origins"))}}
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
        "/openapi.json": {"get": {
            "summary": "This document", "operationId": "openapi",
            "responses": {"200": _json("OpenAPI 3.1", ANY_OBJECT)}}},
    }


def _schemas() -> JSON:
    _, top = models_json_schema([(m, "serialization") for m in MODELS], ref_template=REF)
    return dict(sorted(top.get("$defs", {}).items()))


def _without_auth(ops: dict[str, dict[str, JSON]]) -> None:
    """No token configured: nothing needs Authorization, and nothing answers 401 or 403 for a token
    (a mutation's 403 for a foreign Origin stays: `_guard_answers`)."""
    for methods in ops.values():
        for op in methods.values():
            if op.pop("security", None) is not None:
                for status in ("401", "403"):
                    op["responses"].pop(status, None)


def _guard_answers(method: str, op: JSON) -> None:
    """What the admin listener's guard answers before any route runs (proxy/guards.py): 421 to a
    foreign Host on every call; 403 to a foreign Origin and 415 to a non-JSON body on a mutation."""
    responses = op.setdefault("responses", {})
    responses.setdefault("421", _err("a Host that is not this admin listener's address (loopback, its listen "
                                     "address, or admin.allowed_hosts)"))
    if method in ("get", "head"):
        return
    origin = "an Origin other than this admin's own or admin.cors_origins"
    responses.setdefault("403", _err(f"wrong token, or {origin}" if "security" in op else origin))
    responses.setdefault("415", _err("a body that is not JSON (send none, or Content-Type: application/json)"))


def openapi_document(mounted: Iterable[tuple[str, str]] | None = None, *, token: bool = True) -> JSON:
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
                op.setdefault("responses", {}).setdefault("404", _err("no such tenant"))
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
    def __init__(self, proxy: Proxy) -> None:
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
