"""The ASGI edge of the Host check (decisions in `hosts.py`).

Tenant listeners refuse a Host they do not answer with 403, before anything reaches the engine (a
websocket handshake too). Every refusal is `{"error", "fix", ...}` JSON.
"""

from __future__ import annotations

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from .hosts import host_name

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


async def _answer(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
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
    await _answer(scope, receive, send, tenant_host_refusal(tenant, host))
