"""Streaming HTTP and websocket pass-through to a tenant's upstream.

Nothing is buffered: request bodies stream from the client socket to the upstream, response bytes
(raw, never decoded) stream back as they arrive, so each NDJSON line / SSE event reaches the
client when the engine sends it. When the client goes away the upstream request is closed at once
(Ollama only stops generating when its request is cancelled).

The API is split so admission (plan, release, OOM retry) fits between the steps:
`open()` sends the request and returns once the upstream's headers are in (an `UpstreamResponse`);
`relay()` turns that open response into the client's response.

The relayed requests go through aiohttp (one ClientSession per tenant): its per-request CPU is about
half of httpx's (0.44 vs 0.83-0.95 ms measured on the bench box). httpx stays for the proxy's own
small requests (job polls) and websockets stay on the websockets library.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp
import httpx
import websockets
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from multidict import CIMultiDictProxy
from yarl import URL

from .engines import EngineAdapter, adapter_for, strip_hop_by_hop
from .errors import HyperSwapError
from .tenants import Tenant

log = logging.getLogger("hyperswap.forward")

WS_MAX_SIZE = 256 * 2**20  # ComfyUI previews and outputs can be large; no small cap
KEEPALIVE_EXPIRY_S = 75.0
MAX_HEADER_FIELD = 65536  # aiohttp's 8 KiB default would 502 on a big cookie or CSP header
# aiohttp adds these when absent; a transparent proxy sends only what the client sent.
SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class UpstreamError(HyperSwapError):
    """The upstream refused (502) or did not answer in time (504)."""

    status = 502


def _upstream_error(tenant: Tenant, exc: Exception) -> UpstreamError:
    upstream = tenant.upstream or ""
    details = {"tenant": tenant.name, "upstream": upstream}
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return UpstreamError(f"{tenant.name}: upstream {upstream} did not answer in time ({type(exc).__name__})",
                             fix=f"check that {tenant.name} is running and responsive, or raise "
                                 f"tenants.{tenant.name}.timeouts in tenants.json", status=504, details=details)
    return UpstreamError(f"{tenant.name}: cannot reach upstream {upstream} ({type(exc).__name__}: {exc})",
                         fix=f"start {tenant.name} or correct tenants.{tenant.name}.upstream in tenants.json",
                         status=502, details=details)


def _latin1(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]


OnClose = Callable[[], None]
Tap = Callable[[bytes], None]


class UpstreamResponse:
    """An upstream response whose headers are in and whose body is unread (what `Forwarder.open` returns)."""

    __slots__ = ("_response", "status_code")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code: int = response.status

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """Case-insensitive, repeated names kept."""
        return self._response.headers

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return self._response.raw_headers

    async def aread(self) -> bytes:
        """The whole body (undecoded), then the connection goes back to the pool."""
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"upstream body broke: {type(exc).__name__}: {exc}", status=502) from None
        finally:
            self._response.release()

    def received_body(self) -> bytes | None:
        """The whole body when the upstream has already sent all of it, else None (read nothing)."""
        content = self._response.content
        return content.read_nowait() if content.is_eof() else None

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked framing removed, content encoding untouched)."""
        return self._response.content.iter_any()

    async def aclose(self) -> None:
        # A fully read body leaves a reusable connection; anything else is closed so the upstream sees it.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class RelayResponse(Response):
    """Streams an open upstream response to the client and closes it when either side ends."""

    def __init__(self, upstream: UpstreamResponse, on_close: OnClose, tap: Tap | None = None) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.on_close = on_close
        self.tap = tap
        self.background = None
        self.body = b""
        headers = strip_hop_by_hop(_latin1(list(upstream.raw_headers)))
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        self._closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            whole = self.upstream.received_body()
            if whole is not None:
                # The usual small answer is in already: nothing to wait on, so no disconnect watcher.
                if self.tap is not None and whole:
                    self.tap(whole)
                await send({"type": "http.response.body", "body": whole, "more_body": False})
                return
            await self._stream(receive, send)
        finally:
            # Shielded: a cancelled relay must still close the upstream (Ollama stops generating only then).
            try:
                await asyncio.shield(self.upstream.aclose())
            finally:
                self._finish()

    async def _stream(self, receive: Receive, send: Send) -> None:
        """Relay body chunks until the upstream ends; a client disconnect cancels the wait for the next one.

        A plain asyncio task, not an anyio task group: the group's cancel scopes cost ~20 % of the
        proxy's CPU per small request (py-spy, bench/forwarding.py at c=64)."""
        relay = asyncio.current_task()
        assert relay is not None
        state = {"streaming": True, "client_left": False}

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["streaming"]:
                state["client_left"] = True
                relay.cancel()

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.tap is not None:
                    self.tap(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if not state["client_left"]:
                raise
            relay.uncancel()  # the client went away: that ends this response, not the task
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Headers are gone already: the status cannot change, end the body instead.
            log.warning("upstream stream broke mid-response: %s", exc)
        finally:
            state["streaming"] = False
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.on_close()
            except Exception:
                log.exception("relay on_close callback failed")


@dataclass(frozen=True, slots=True)
class _TenantPools:
    tenant: Tenant
    session: aiohttp.ClientSession  # relayed requests
    base: str  # scheme://host:port of the upstream, joined to the raw path per request
    client: httpx.AsyncClient  # the proxy's own small requests (job polls)


class Forwarder:
    """One aiohttp session per tenant (and an httpx client for job polls), created on first use.

    `pool_shards` is kept for callers of the httpx version and ignored: aiohttp's connector does not
    collapse under concurrency the way one httpcore pool did.
    """

    def __init__(self, *, max_keepalive: int = 256, pool_shards: int = 1) -> None:
        self._pools: dict[str, _TenantPools] = {}
        self._adapters: dict[str, EngineAdapter] = {}
        self._retired: list[_TenantPools] = []
        self._ssl: ssl.SSLContext | None = None  # one for all sessions: each load costs ~30 ms
        self.max_keepalive = max_keepalive
        self.pool_shards = max(1, pool_shards)

    def adapter(self, tenant: Tenant) -> EngineAdapter:
        adapter = self._adapters.get(tenant.name)
        if adapter is None or adapter.tenant is not tenant:
            adapter = self._adapters[tenant.name] = adapter_for(tenant)
        return adapter

    def _tenant_pools(self, tenant: Tenant) -> _TenantPools:
        pools = self._pools.get(tenant.name)
        if pools is None or pools.tenant is not tenant:
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            t = tenant.timeouts
            # No total or read timeout by default: a model load sends nothing for minutes.
            timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_read=t.read_s)
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY_S,
                                             ssl=self._ssl, enable_cleanup_closed=False)
            session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False, skip_auto_headers=SKIP_AUTO_HEADERS, trust_env=False,
                max_field_size=MAX_HEADER_FIELD, max_line_size=MAX_HEADER_FIELD, raise_for_status=False)
            # httpx defaults (5 s everywhere) would cut a slow history answer: same timeouts as relays.
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.write_s, pool=t.pool_s),
                follow_redirects=False, trust_env=False, verify=self._ssl)
            if pools is not None:  # the tenant was reloaded: the old session stays open for responses in flight
                self._retired.append(pools)
            base = str(URL(tenant.upstream or "").origin())  # the raw path replaces any path in upstream
            pools = self._pools[tenant.name] = _TenantPools(tenant, session, base, client)
        return pools

    def client(self, tenant: Tenant) -> httpx.AsyncClient:
        """A client for the proxy's own requests to this tenant (job polls)."""
        return self._tenant_pools(tenant).client

    async def open(self, tenant: Tenant, request: Request | Scope,
                   body: bytes | AsyncIterator[bytes]) -> UpstreamResponse:
        """Send the request upstream; return once its status and headers arrived (body unread).
        `request` is a Starlette Request or the bare ASGI scope (the listener's passthrough path)."""
        scope: Scope = request.scope if isinstance(request, Request) else request
        method: str = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
        query: bytes = scope.get("query_string", b"")
        client_addr = scope.get("client")
        headers = self.adapter(tenant).upstream_headers(
            _latin1(scope["headers"]), client_ip=client_addr[0] if client_addr else None,
            scheme=scope.get("scheme", "http"))
        data: bytes | AsyncIterator[bytes] | None = body
        if isinstance(body, bytes):
            # A replayed (buffered) body: its length is known, whatever the client framed it with.
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            if body or method not in ("GET", "HEAD"):
                headers.append(("content-length", str(len(body))))
            else:
                data = None
        pools = self._tenant_pools(tenant)
        # encoded=True: the client's path and query go upstream byte for byte, never re-quoted.
        url = URL(pools.base + raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""),
                  encoded=True)
        try:
            response = await pools.session.request(method, url, headers=headers, data=data,
                                                   allow_redirects=False, compress=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _upstream_error(tenant, exc) from None
        return UpstreamResponse(response)

    def relay(self, tenant: Tenant, upstream_response: UpstreamResponse, on_close: OnClose,
              *, tap: Tap | None = None) -> Response:
        """A response that streams the upstream body and calls on_close exactly once at the end."""
        return RelayResponse(upstream_response, on_close, tap)

    async def get(self, tenant: Tenant, path: str) -> httpx.Response:
        """A small GET of the proxy's own (job polls), read fully."""
        client = self.client(tenant)
        return await client.get(f"{tenant.upstream}{path}", headers={"host": self.adapter(tenant).upstream_host})

    async def job_done(self, tenant: Tenant, job_id: str) -> bool:
        adapter = self.adapter(tenant)
        path = adapter.history_path(job_id)
        if path is None:
            return False
        resp = await self.get(tenant, path)
        return adapter.job_done_from_history(job_id, resp.status_code, resp.content)

    # -- websockets -----------------------------------------------------------------------
    async def websocket(self, tenant: Tenant, ws: WebSocket,
                        on_upstream_text: Callable[[str], None] | None = None) -> None:
        """Bridge a client websocket to the same path and query upstream, frames and close codes both ways."""
        adapter = self.adapter(tenant)
        scope = ws.scope
        client_scheme = scope.get("scheme", "ws")
        headers = adapter.upstream_headers(
            _latin1(ws.headers.raw), client_ip=ws.client.host if ws.client else None,
            scheme=client_scheme, websocket=True)
        origin = next((v for k, v in headers if k.lower() == "origin"), None)
        extra = [(k, v) for k, v in headers if k.lower() not in ("host", "origin")]
        ua = ws.headers.get("user-agent")
        if ua:
            extra.append(("User-Agent", ua))
        subprotocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        base = httpx.URL(tenant.upstream or "")
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
        query: bytes = scope.get("query_string", b"")
        uri = (("wss" if base.scheme == "https" else "ws") + "://" + adapter.upstream_host
               + raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""))
        try:
            upstream = await connect(
                uri, origin=origin, additional_headers=extra, user_agent_header=None,  # type: ignore[arg-type]
                subprotocols=subprotocols or None, compression=None, proxy=None,
                open_timeout=tenant.timeouts.connect_s, ping_interval=None, ping_timeout=None,
                close_timeout=5, max_size=WS_MAX_SIZE, max_queue=64,
            )
        except websockets.InvalidStatus as exc:
            status = exc.response.status_code
            log.info("%s: upstream refused websocket %s with %d", tenant.name, scope["path"], status)
            await ws.send_denial_response(Response(exc.response.body or b"", status_code=status)) \
                if "websocket.http.response" in scope.get("extensions", {}) else await ws.close(1008)
            return
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as exc:
            log.warning("%s: cannot open upstream websocket: %s", tenant.name, exc)
            err = _upstream_error(tenant, exc if not isinstance(exc, asyncio.TimeoutError) else httpx.ConnectTimeout(str(exc)))
            if "websocket.http.response" in scope.get("extensions", {}):
                from starlette.responses import JSONResponse
                await ws.send_denial_response(JSONResponse(err.to_json(), status_code=err.status))
            else:
                await ws.close(1011)
            return
        async with upstream:
            await ws.accept(subprotocol=upstream.subprotocol)
            await self._bridge(ws, upstream, on_upstream_text)

    async def _bridge(self, ws: WebSocket, upstream: ClientConnection,
                      on_text: Callable[[str], None] | None) -> None:
        async def client_to_upstream() -> None:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    code = int(message.get("code") or 1000)
                    await upstream.close(_sendable(code), message.get("reason") or "")
                    return
                if message.get("text") is not None:
                    await upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send(message["bytes"])

        async def upstream_to_client() -> None:
            try:
                async for frame in upstream:
                    if isinstance(frame, str):
                        if on_text is not None:
                            on_text(frame)
                        await ws.send_text(frame)
                    else:
                        await ws.send_bytes(frame)
            except websockets.ConnectionClosed:
                pass
            code = upstream.close_code if upstream.close_code is not None else 1011
            reason = upstream.close_reason or ""
            if ws.client_state != WebSocketState.DISCONNECTED and ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                    await ws.close(_sendable(code), reason)

        tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.warning("websocket bridge ended with %r", task.exception())
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def aclose(self) -> None:
        groups, self._pools, self._retired = [*self._pools.values(), *self._retired], {}, []
        for pools in groups:
            await pools.session.close()
            await pools.client.aclose()


def _sendable(code: int) -> int:
    # 1005 (no code) and 1006 (abnormal) are reserved: they may not appear in a close frame.
    if code == 1005:
        return 1000
    if code in (1006, 1015) or code < 1000:
        return 1011
    return code
