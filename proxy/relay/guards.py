"""The ASGI edge of the Host, Origin and body checks (decisions in `hosts.py`).

Tenant listeners refuse a Host they do not answer with 403, before anything reaches the engine (a
websocket handshake too). The admin API refuses a foreign Host with 421, and for a mutation a foreign
Origin (403) or a body that is not JSON (415): a plain web page can POST a form anywhere, and a
browser only lets a page send JSON cross-origin after a CORS preflight the admin does not grant.
Every refusal is `{"error", "fix", ...}` JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from proxy.engines.base import same_origin
from proxy.hosts import HostPolicy, host_name

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SHOWN_MAX = 200  # a Host echoed in an answer is the client's; keep the echo short


def host_header(scope: Scope) -> str | None:
    """The Host header as sent, "" when absent, None when there are several (ambiguous: refused)."""
    found: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"host":
            if found is not None:
                return None
            found = value
    return "" if found is None else found.decode("latin-1")


def _shown(host: str | None) -> str:
    return "(several Host headers)" if host is None else host[:SHOWN_MAX]


async def answer(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
    """An HTTP answer, or for a websocket handshake the same answer instead of the upgrade."""
    if scope["type"] == "http":
        await response(scope, receive, send)
        return
    ws = WebSocket(scope, receive, send)
    if "websocket.http.response" in scope.get("extensions", {}):
        await ws.send_denial_response(response)
    else:  # a server without the denial extension answers a close before accept with a bare 403
        await ws.close(1008)


def tenant_host_refusal(tenant: str, host: str | None) -> JSONResponse:
    name = host_name(host or "")[:SHOWN_MAX]
    fix = (f"open {tenant} as localhost or 127.0.0.1; if you use the name {name!r} on purpose, add "
           f"\"{name}\" to tenants.{tenant}.allowed_hosts in tenants.json") if host else "send exactly one Host header"
    return JSONResponse({
        "error": f"Host {_shown(host)!r} is not allowed on the {tenant} listener: a web page under a name that "
                 f"points at this machine (DNS rebinding) must not reach {tenant}",
        "fix": fix, "tenant": tenant}, status_code=403)


async def refuse_tenant_host(scope: Scope, receive: Receive, send: Send, tenant: str, host: str | None) -> None:
    await answer(scope, receive, send, tenant_host_refusal(tenant, host))


def _json_or_empty(headers: Headers) -> bool:
    """A mutation carries no body or a JSON one: JSON is what a page cannot send cross-origin unasked."""
    ctype = headers.get("content-type")
    if ctype is None:
        return headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
    media = ctype.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class AdminGuard:
    """Host check for every admin request, Origin and body checks for every mutation."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy, cors_origins: Sequence[str] = ()) -> None:
        self.app = app
        self.hosts = hosts
        self.cors_origins = frozenset(cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.refusal(scope)
            if refusal is not None:
                await answer(scope, receive, send, refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        host = host_header(scope)
        if host is None or not self.hosts.allows(host):
            return self._misdirected(scope, host)
        if scope.get("method", "GET") in SAFE_METHODS:
            return None
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host, scope):
            return JSONResponse({
                "error": f"cross-origin {scope['method']} from {origin[:SHOWN_MAX]!r} refused: a web page on another "
                         "origin must not change this proxy",
                "fix": "use the dashboard on this admin address, or a client that sends no Origin (curl, the CLI, MCP); "
                       "to let another page call the admin API, list its origin in admin.cors_origins in tenants.json"},
                status_code=403)
        if not _json_or_empty(headers):
            return JSONResponse({
                "error": f"{scope['method']} {scope['path']} takes no body or a JSON one, "
                         f"got Content-Type {headers.get('content-type', '(none)')[:SHOWN_MAX]!r}",
                "fix": "send the request without a body (curl -X POST URL), or with Content-Type: application/json"},
                status_code=415)
        return None

    def _origin_allowed(self, origin: str, host: str, scope: Scope) -> bool:
        if origin in self.cors_origins or "*" in self.cors_origins:
            return True  # the operator allowed that page in tenants.json
        return bool(host) and same_origin(origin, host, scope.get("scheme", "http"))

    @staticmethod
    def _misdirected(scope: Scope, host: str | None) -> JSONResponse:
        server = scope.get("server") or ("127.0.0.1", 0)
        own = server[0] if server[0] not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{'[' + own + ']' if ':' in own else own}:{server[1]}"
        name = host_name(host or "")[:SHOWN_MAX]
        fix = (f"open the admin API as {url}; if you reach it under the name {name!r} on purpose, add \"{name}\" "
               "to admin.allowed_hosts in tenants.json") if host else "send exactly one Host header"
        return JSONResponse({
            "error": f"Host {_shown(host)!r} is not an address of this admin API: a web page under a name that "
                     "points at this machine (DNS rebinding) must not read or drive it",
            "fix": fix}, status_code=421)
