"""MCP tools over the admin API: health, engines, tenants, plan (dry run), release, start, stop.

One code path: every tool is a call to the admin API over HTTP, so the tools answer exactly what
the REST API answers. Served two ways:
- stdio (`python -m proxy.admin.mcp_tools --admin URL`, or `mcp_main`) against a running proxy; the
  admin token, when the proxy has one, comes from HYPERSWAP_ADMIN_TOKEN;
- streamable HTTP at /mcp on the admin listener (`mcp_extension`), calling the admin API over
  loopback. When the proxy has a token the whole /mcp endpoint needs `Authorization: Bearer`.

Named mcp_tools.py, not mcp.py: inside the package a `proxy/admin/mcp.py` would not shadow the SDK for
absolute imports, but `python -m proxy.admin.mcp` run from proxy/admin/ or any sys.path slip would, and
`from . import mcp` next to `import mcp` reads as a trap.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Annotated
from urllib.parse import quote

import httpx
from pydantic import Field
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.admin.health_report import HealthReport
from proxy.admin.proxy_view import ProxyView
from proxy.admin.views import DryRun, EngineList, LifecycleAnswer, ModelList, ReleaseResult, TenantList
from proxy.config.bounds import MAX_GIB
from proxy.errors import McpNotInstalled
from proxy.tls import client_context

try:
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations
except ImportError as exc:  # the [mcp] extra is not installed
    if __name__ == "__main__" and McpNotInstalled.caused(exc):  # `python -m proxy.admin.mcp_tools`: as the CLI says it
        print(McpNotInstalled().one_line(), file=sys.stderr)
        sys.exit(2)
    raise  # an import: proxy.admin.mcp_extra turns it into a 501 at /mcp, or the CLI's one line

TOKEN_ENV = "HYPERSWAP_ADMIN_TOKEN"
TIMEOUT_S = 60.0  # a release waits for the GPU to show the memory back (release_timeout_s)
READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
MUTATING = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)


class AdminClient:
    """The admin API over HTTP. `base_url` and `token` are read at call time (the in-process admin
    listener's port is known only once it is bound)."""

    def __init__(self, base_url: Callable[[], str], token: Callable[[], str | None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url
        self.token = token
        self.transport = transport

    async def call(self, method: str, path: str, params: dict[str, str] | None = None,
                   mutating: bool = False) -> dict[str, object]:
        """The JSON answer of a 2xx; anything else becomes a ToolError with the API's message and fix."""
        base = self.base_url().rstrip("/")
        headers: dict[str, str] = {}
        token = self.token()
        if mutating and token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT_S, trust_env=False, transport=self.transport,
                                         verify=client_context()) as client:
                r = await client.request(method, base + path, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise ToolError(f"cannot reach the HyperSwap admin API at {base} ({type(exc).__name__}: {exc}). "
                            "Fix: start it with `hyperswap serve`, or point the MCP server at it with --admin URL") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ToolError(f"{method} {path} answered {r.status_code} without a JSON object "
                            f"(is {base} a HyperSwap admin listener?)")
        if r.status_code >= 400:
            raise ToolError(error_text(r.status_code, body))
        return body


def error_text(status: int, body: Mapping[str, object]) -> str:
    """One line an agent can act on: the API's sentence, its reason, the fix, and the rest as JSON."""
    text = f"HTTP {status}: {body.get('error') or 'failed'}"
    if body.get("reason"):
        text += f" (reason: {body['reason']})"
    if body.get("fix"):
        text += f". Fix: {body['fix']}"
    rest = {k: v for k, v in body.items() if k not in ("error", "reason", "fix")}
    if rest:
        text += f". Details: {json.dumps(rest, sort_keys=True)}"
    return text


def build_server(admin: AdminClient) -> MCPServer:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    server: MCPServer = MCPServer(
        "hyperswap", title="HyperSwap",
        instructions=("HyperSwap shares one GPU between Ollama, ComfyUI and other apps. Read `tenants` and `plan` "
                      "before `release`: a release unloads a tenant's models to free GPU memory. `start` and "
                      "`stop` act on tenants the proxy starts and stops (their `lifecycle` in `tenants`)."),
        warn_on_duplicate_tools=False)
    # MCPServer() calls logging.basicConfig(INFO): the proxy's logging is not the SDK's to set.
    root.handlers[:], root.level = saved[0], saved[1]

    @server.tool(annotations=READ_ONLY)
    async def health() -> HealthReport:
        """Self-check of the proxy: GPU reader, engines, config. Each entry says ok, degraded or failed, with its fix."""
        return HealthReport.model_validate(await admin.call("GET", "/api/health"))

    @server.tool(annotations=READ_ONLY)
    async def engines() -> EngineList:
        """Each tenant's engine (Ollama, ComfyUI): reachable, version, settings and what it reports about itself."""
        return EngineList.model_validate(await admin.call("GET", "/api/engines"))

    @server.tool(annotations=READ_ONLY)
    async def tenants() -> TenantList:
        """Every tenant sharing the GPU with its live state: VRAM held, busy and why, idle-release timer, reclaimable,
        and for a tenant the proxy starts and stops its lifecycle (running, stopped, starting, stopping, failed)."""
        return TenantList.model_validate(await admin.call("GET", "/api/tenants"))

    @server.tool(annotations=READ_ONLY)
    async def plan(
        tenant: Annotated[str, Field(description="the tenant that would need the memory, e.g. ollama")],
        need_gb: Annotated[float | None, Field(ge=0, le=MAX_GIB,
                                               description="GiB needed; default: the tenant's needs_vram_gb")] = None,
    ) -> DryRun:
        """Dry run: what would be released for `tenant` to get `need_gb` GiB, and what blocks it. Executes nothing."""
        params = {"tenant": tenant}
        if need_gb is not None:
            params["need_gb"] = repr(float(need_gb))
        return DryRun.model_validate(await admin.call("GET", "/api/plan", params=params))

    @server.tool(annotations=READ_ONLY)
    async def models(tenant: Annotated[str | None, Field(description="one tenant, e.g. ollama; default: all")] = None
                     ) -> ModelList:
        """Each tenant's model files: size, how much is in host RAM (page cache; a cold file loads at disk speed),
        and any warm in progress. Residency the proxy cannot read is null with the reason, never 0."""
        return ModelList.model_validate(await admin.call("GET", "/api/models", params={"tenant": tenant} if tenant else None))

    @server.tool(annotations=MUTATING)
    async def release(tenant: Annotated[str, Field(description="the tenant to release, e.g. comfyui")]) -> ReleaseResult:
        """Release an idle tenant's GPU memory now (unloads its models). Refused for a busy tenant or one with no
        release strategy. Returns the bytes freed as measured on the GPU."""
        path = f"/api/tenants/{quote(tenant, safe='')}/release"
        return ReleaseResult.model_validate(await admin.call("POST", path, mutating=True))

    @server.tool(annotations=MUTATING)
    async def start(tenant: Annotated[str, Field(description="a tenant the proxy starts and stops, e.g. llama")]
                    ) -> LifecycleAnswer:
        """Start a tenant the proxy starts and stops (release kind process, systemd or docker): its GPU memory is
        made free first as for a request (idle tenants released), then it is started and awaited until ready.
        Refused for other tenants; fails with the reason and the app's last output lines."""
        path = f"/api/tenants/{quote(tenant, safe='')}/start"
        return LifecycleAnswer.model_validate(await admin.call("POST", path, mutating=True))

    @server.tool(annotations=MUTATING)
    async def stop(tenant: Annotated[str, Field(description="a tenant the proxy starts and stops, e.g. llama")]
                   ) -> LifecycleAnswer:
        """Stop an idle tenant the proxy starts and stops, freeing all its GPU memory; its next request starts it
        again. Refused for a busy or starting tenant and for one the proxy does not start and stop."""
        path = f"/api/tenants/{quote(tenant, safe='')}/stop"
        return LifecycleAnswer.model_validate(await admin.call("POST", path, mutating=True))

    return server


# -- streamable HTTP on the admin listener ---------------------------------------------------------

class _BearerGate:
    """The SDK's ASGI app behind the admin token (when one is configured)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is not None and scope["type"] == "http":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not auth.lower().startswith("bearer "):
                return await _json(send, 401, {"error": "the MCP endpoint needs a bearer token",
                                               "fix": "send `Authorization: Bearer <token>` (the token from "
                                                      "HYPERSWAP_ADMIN_TOKEN or admin.token_file)"})
            if not hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()):
                return await _json(send, 403, {"error": "wrong admin token", "fix": "use the token the proxy was started with"})
        await self.app(scope, receive, send)


async def _json(send: Send, status: int, body: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _loopback(url: str) -> str:
    for wildcard in ("://0.0.0.0:", "://[::]:", "://:::"):
        url = url.replace(wildcard, "://127.0.0.1:")
    return url


class McpExtension:
    """/mcp on the admin listener. Stateless JSON answers: no session outlives a request, so stop() is quick.

    The SDK's server is built and its session manager started on the first /mcp request, not with
    the proxy: building the tools' schemas costs ~130 ms of CPU, which every `hyperswap serve` start
    (and every test's proxy) paid whether or not an MCP client ever came."""

    def __init__(self, proxy: ProxyView) -> None:
        self.proxy = proxy
        self.admin = AdminClient(lambda: _loopback(proxy.servers["admin"].url), lambda: proxy.token)
        self.server: MCPServer | None = None
        self.app = _BearerGate(self._serve, proxy.token)
        self._stopping = asyncio.Event()
        self._starting = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def routes(self) -> list[BaseRoute]:
        return [Route("/mcp", self.app, methods=["GET", "POST", "DELETE"])]

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._stopping.is_set():
            return await _json(send, 503, {"error": "the proxy is stopping", "fix": "retry once it is running again"})
        server = await self._running()
        await server.session_manager.handle_request(scope, receive, send)

    async def _running(self) -> MCPServer:
        async with self._starting:
            if self.server is None or self._task is None:
                server = build_server(self.admin)
                host = self.proxy.registry.config.admin.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
                # host decides the SDK's DNS-rebinding check: on for loopback listeners, off for public ones (token-guarded).
                server.streamable_http_app(streamable_http_path="/mcp", stateless_http=True, json_response=True, host=host)
                started = asyncio.Event()

                async def run() -> None:
                    # The session manager's task group must be entered and left by one task: this one.
                    async with server.session_manager.run():
                        started.set()
                        await self._stopping.wait()

                task = asyncio.create_task(run(), name="mcp-session-manager")
                waiter = asyncio.create_task(started.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if task.done():
                    task.result()  # raises what broke the start
                self.server, self._task = server, task
            return self.server

    async def start(self) -> None:
        """Nothing to start until the first /mcp request (see the class)."""

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._task, timeout=5)
        except TimeoutError:
            self._task.cancel()
        self._task = None


def mcp_extension(proxy: ProxyView) -> McpExtension:
    return McpExtension(proxy)


# -- stdio -----------------------------------------------------------------------------------------

def mcp_main(config: str | None, admin_url: str | None) -> int:
    """`hyperswap mcp`: the MCP tools over stdio, against the proxy whose admin listener is at
    `admin_url` (or the one `config`'s admin.listen names). Never writes to stdout but the protocol."""
    from proxy.admin.address import admin_base_url
    from proxy.errors import HyperSwapError

    try:
        base = admin_base_url(config, admin_url)
    except HyperSwapError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # stdout carries the protocol
    server = build_server(AdminClient(lambda: base, lambda: token))
    try:
        asyncio.run(server.run_stdio_async())
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.admin.mcp_tools", description="HyperSwap MCP tools over stdio")
    p.add_argument("--config", help="tenants.json whose admin.listen names the proxy")
    p.add_argument("--admin", help="admin API URL of a running proxy, e.g. http://127.0.0.1:11400")
    args = p.parse_args(argv)
    return mcp_main(args.config, args.admin)


if __name__ == "__main__":
    sys.exit(main())
