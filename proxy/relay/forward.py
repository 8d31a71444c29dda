"""Streaming HTTP and websocket pass-through to a tenant's upstream.

Nothing is buffered: request bodies stream from the client socket to the upstream, response bytes
(raw, never decoded) stream back as they arrive, so each NDJSON line / SSE event reaches the
client when the engine sends it. When the client goes away the upstream request is closed at once
(Ollama only stops generating when its request is cancelled).

The API is split so admission (plan, release, OOM retry) fits between the steps:
`open()` sends the request and returns once the upstream's headers are in (an `UpstreamResponse`);
`relay()` turns that open response into the client's response.

Relayed requests go through `http1.Pool` (one keep-alive pool per tenant, at most
`max_connections` to each upstream; why not aiohttp or httpx is in that module). httpx stays for
the proxy's own small requests (job polls) and websockets stay on the websockets library.

Errors: an upstream that refuses the connection or sends an answer the relay cannot pass on (a
101 to a plain request, a transfer coding other than chunked) is a 502; one that does not answer
in time a 504; every connection to it staying busy for pool_s a 503. An upstream that breaks once
its answer has started cannot change the status any more: the client's connection is closed, so
it sees the answer cut short, and the relay logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import websockets
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from proxy.config.schema import Tenant
from proxy.engines import AdapterCache, strip_hop_by_hop
from proxy.engines.ports import Header, HostAndHeaders
from proxy.errors import HyperSwapError
from proxy.memo import remember
from proxy.relay import http1
from proxy.relay.inbound import ABORT, HEAD_WITH_BODY
from proxy.tls import client_context

log = logging.getLogger("hyperswap.forward")

WS_MAX_SIZE = 256 * 2**20  # ComfyUI previews and outputs can be large; no small cap
BODILESS = frozenset({204, 304})  # RFC 9110 6.4.1: never a body, whatever the headers say
# A whole body up to this size goes out in one send with its head (inbound.HEAD_WITH_BODY): joining
# them copies the body, which past this costs more than the second send it saves.
HEAD_WITH_BODY_MAX = 16 * 1024
UNFRAMED_KEPT_MAX = 64  # client header sets whose upstream headers a forwarder remembers (Forwarder._unframed_headers)


class UpstreamError(HyperSwapError):
    """The upstream refused (502) or did not answer in time (504)."""

    status = 502


def upstream_error(tenant: Tenant, exc: Exception) -> UpstreamError:
    """What the client is told when its upstream request failed this way (502, 503 or 504)."""
    upstream = tenant.upstream or ""
    details = {"tenant": tenant.name, "upstream": upstream}
    if isinstance(exc, http1.PoolTimeout):
        return UpstreamError(f"{tenant.name}: every connection to upstream {upstream} stayed busy ({exc})",
                             fix=f"retry later; to let requests wait longer for a free connection, raise "
                                 f"tenants.{tenant.name}.timeouts.pool_s in tenants.json", status=503, details=details)
    if isinstance(exc, http1.UpstreamProtocolError):
        return UpstreamError(f"{tenant.name}: upstream {upstream} sent an answer the proxy cannot relay: {exc}",
                             fix=f"check that tenants.{tenant.name}.upstream in tenants.json is the engine's own HTTP "
                                 f"address, not another proxy's or a websocket-only port", status=502, details=details)
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return UpstreamError(f"{tenant.name}: upstream {upstream} did not answer in time ({type(exc).__name__})",
                             fix=f"check that {tenant.name} is running and responsive, or raise "
                                 f"tenants.{tenant.name}.timeouts in tenants.json", status=504, details=details)
    if isinstance(exc, http1.UpstreamClosed):
        # It accepted the connection, so it runs there: "start it" would be false.
        return UpstreamError(f"{tenant.name}: upstream {upstream} accepted the connection, then {_what_it_did(exc)} "
                             f"without answering", status=502, details=details,
                             fix=f"retry the request (the proxy does not send a request the engine may have started "
                                 f"twice); if it keeps happening, {tenant.name}'s own log says why it drops requests "
                                 f"(an error on an earlier request, a crash, a connection limit)")
    if isinstance(exc, ConnectionRefusedError):
        return UpstreamError(f"{tenant.name}: upstream {upstream} refused the connection: nothing listens there",
                             fix=f"start {tenant.name} or correct tenants.{tenant.name}.upstream in tenants.json",
                             status=502, details=details)
    return UpstreamError(f"{tenant.name}: cannot reach upstream {upstream} ({type(exc).__name__}: {exc})",
                         fix=f"start {tenant.name} or correct tenants.{tenant.name}.upstream in tenants.json",
                         status=502, details=details)


def _what_it_did(exc: http1.UpstreamClosed) -> str:
    text = str(exc)
    if "reset" in text:
        return "reset the connection"
    if "while we were sending" in text:
        return "closed the connection while the request was being sent"
    return "closed the connection"


def _latin1(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]


OnClose = Callable[[], None]
Tap = Callable[[bytes], None]
Activity = Callable[[], None]  # a chunk of a streamed answer passed


class UpstreamResponse:
    """An upstream response whose headers are in and whose body is unread (what `Forwarder.open` returns)."""

    __slots__ = ("_response", "status_code")

    def __init__(self, response: http1.Response) -> None:
        self._response = response
        self.status_code: int = response.status_code

    @property
    def headers(self) -> Headers:
        """Case-insensitive, repeated names kept (`getlist`)."""
        return self._response.headers

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return self._response.raw_headers

    async def aread(self) -> bytes:
        """The whole body (undecoded), then the connection goes back to the pool."""
        try:
            return await self._response.aread()
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"upstream body broke: {type(exc).__name__}: {exc}", status=502) from None
        finally:
            self._response.close()

    def received_body(self) -> bytes | None:
        """The whole body when the upstream has already sent all of it, else None (read nothing)."""
        return self._response.received_body()

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked framing removed, content encoding untouched)."""
        return self._response.aiter_raw()

    def close(self) -> None:
        """A fully read body leaves a reusable connection; anything else is dropped so the upstream sees it."""
        self._response.close()

    async def aclose(self) -> None:
        self._response.close()


class RelayResponse(Response):
    """Streams an open upstream response to the client and closes it when either side ends."""

    def __init__(self, upstream: UpstreamResponse, on_close: OnClose, tap: Tap | None = None,
                 tenant_name: str = "", activity: Activity | None = None) -> None:
        self.upstream = upstream
        self.activity = activity
        self.status_code = upstream.status_code
        self.on_close = on_close
        self.tap = tap
        self.tenant_name = tenant_name
        self.background = None
        self.body = b""
        self.raw_headers = strip_hop_by_hop(upstream.raw_headers)
        if self.status_code in BODILESS:
            # A 304 may carry the representation's Content-Length (RFC 9110 8.6), a 204 should not;
            # uvicorn takes it as the length of the body it must send and resets the connection when
            # none comes. A cache does not update Content-Length from a 304 (RFC 9111 3.2), so the
            # client loses nothing.
            self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            whole = self.upstream.received_body()
            if whole is None:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                await self._stream(scope, send)
                return
            # The usual small answer is in already: sent whole, in one piece, and with its head in one
            # send when it is small (a bigger one would be copied to join them: two sends cost less).
            if len(whole) <= HEAD_WITH_BODY_MAX:
                hold = scope.get("extensions", {}).get(HEAD_WITH_BODY)
                if hold is not None:
                    hold["hold"](scope)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self.tap is not None and whole:
                self.tap(whole)
            await send({"type": "http.response.body", "body": whole, "more_body": False})
        finally:
            # Synchronous, so even a cancelled relay drops the upstream (Ollama stops generating only then).
            try:
                self.upstream.close()
            finally:
                self._finish()

    async def _stream(self, scope: Scope, send: Send) -> None:
        """Relay body chunks until the upstream ends. A client that leaves is noticed by the
        listener's ClientLink, which cancels this task; `__call__`'s finally drops the upstream."""
        relayed = 0
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.tap is not None:
                    self.tap(chunk)
                if self.activity is not None:
                    self.activity()
                relayed += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (OSError, TimeoutError) as exc:
            self._broke(scope, relayed, exc)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _broke(self, scope: Scope, relayed: int, exc: Exception) -> None:
        """The upstream broke after the status went out: the client must see a broken answer, never
        a short one as whole, so its connection is closed (the listener's abort extension does it
        without uvicorn's error line; elsewhere returning unfinished has the server do it)."""
        log.warning("%s: upstream broke mid-answer to %s %s after %d body bytes (%s: %s); the client's "
                    "connection was closed, so it sees the answer cut short", self.tenant_name or "relay",
                    scope.get("method"), scope.get("path"), relayed, type(exc).__name__, exc)
        abort = scope.get("extensions", {}).get(ABORT, {}).get("abort")
        if callable(abort):
            abort(scope)

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
    relay: http1.Pool  # relayed requests
    client: httpx.AsyncClient  # the proxy's own small requests (job polls)


class Forwarder:
    """One relay pool per tenant (and an httpx client for job polls), created on first use."""

    def __init__(self, *, max_keepalive: int = 256, max_connections: int = http1.MAX_CONNECTIONS,
                 state_dir: Path | None = None) -> None:
        self._pools: dict[str, _TenantPools] = {}
        # the one adapter per tenant every part of the proxy asks (service.py); what they learn is kept in state_dir
        self.adapter = AdapterCache(state_dir)
        self._retired: list[_TenantPools] = []
        self.max_keepalive = max_keepalive
        self.max_connections = max_connections  # per upstream
        # (tenant, client headers less Content-Length, client address, scheme) -> (adapter, upstream headers)
        self._unframed: dict[tuple[str, tuple[Header, ...], str | None, str], tuple[object, http1.RawHeaders]] = {}

    def _tenant_pools(self, tenant: Tenant) -> _TenantPools:
        pools = self._pools.get(tenant.name)
        if pools is None or pools.tenant is not tenant:
            t = tenant.timeouts
            # No read timeout by default: a model load sends nothing for minutes.
            # A request waits for a free connection at most pool_s (POOL_WAIT_S when unset), then 503.
            relay = http1.Pool(tenant.upstream or "", connect_s=t.connect_s, read_s=t.read_s, write_s=t.write_s,
                               ssl_context=client_context(), max_idle=self.max_keepalive,
                               max_connections=self.max_connections,
                               pool_s=t.pool_s if t.pool_s is not None else http1.POOL_WAIT_S)
            # httpx defaults (5 s everywhere) would cut a slow history answer: same timeouts as relays.
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.write_s, pool=t.pool_s),
                follow_redirects=False, trust_env=False, verify=client_context())
            if pools is not None:
                # The tenant was reloaded: the old pool's idle connections go now, those in use when
                # their answer ends; the old httpx client closes with the forwarder.
                pools.relay.close()
                self._retired.append(pools)
            pools = self._pools[tenant.name] = _TenantPools(tenant, relay, client)
        return pools

    def client(self, tenant: Tenant) -> httpx.AsyncClient:
        """A client for the proxy's own requests to this tenant (job polls)."""
        return self._tenant_pools(tenant).client

    async def open(self, tenant: Tenant, request: Request | Scope,
                   body: bytes | AsyncIterator[bytes]) -> UpstreamResponse:
        """Send the request upstream; return once its status and headers arrived (body unread).
        `request` is a Starlette Request or the bare ASGI scope (the listener's passthrough path)."""
        scope: Scope = request.scope if isinstance(request, Request) else request
        method, target, headers, data = self._upstream_request(tenant, scope, body)
        try:
            response = await self._tenant_pools(tenant).relay.request(method, target, headers, data)
        except (OSError, TimeoutError) as exc:
            raise upstream_error(tenant, exc) from None
        return UpstreamResponse(response)

    def inline_head(self, tenant: Tenant, scope: Scope) -> bytes:
        """The head a bodiless request sends upstream, exactly as `open` would send it."""
        method, target, headers, _ = self._upstream_request(tenant, scope, b"")
        return http1.request_head(method, target, headers)

    def send_now(self, tenant: Tenant, head: bytes, receiver: Callable[[http1.Connection], http1.R]) -> http1.R | None:
        """A bodiless GET whose head is `inline_head`'s, sent at once on an idle connection of the
        tenant's pool, its answer to `receiver(connection)` (`http1.Pool.send_now`); None: nothing was sent."""
        return self._tenant_pools(tenant).relay.send_now(head, receiver)

    def _upstream_request(self, tenant: Tenant, scope: Scope, body: bytes | AsyncIterator[bytes]
                          ) -> tuple[str, bytes, http1.RawHeaders, bytes | AsyncIterator[bytes] | None]:
        """The method, target, headers and body that go upstream for this client request."""
        method: str = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
        query: bytes = scope.get("query_string", b"")
        client_addr = scope.get("client")
        client_ip = client_addr[0] if client_addr else None
        scheme: str = scope.get("scheme", "http")
        data: bytes | AsyncIterator[bytes] | None = body
        if not isinstance(body, bytes):
            headers = self.adapter(tenant).upstream_headers(scope["headers"], client_ip=client_ip, scheme=scheme)
        else:
            # A replayed (buffered) body: its length is known, whatever the client framed it with.
            headers = self._unframed_headers(tenant, scope["headers"], client_ip, scheme)
            if body or method not in ("GET", "HEAD"):
                headers.append((b"content-length", b"%d" % len(body)))
            else:
                data = None
        # The client's path and query go upstream byte for byte (never re-quoted); any path in
        # `upstream` is replaced by the client's.
        target = raw_path + b"?" + query if query else raw_path
        return method, target, headers, data

    def _unframed_headers(self, tenant: Tenant, client_headers: Iterable[Header], client_ip: str | None,
                          scheme: str) -> http1.RawHeaders:
        """The adapter's upstream headers for a request whose body the proxy frames itself (no
        Content-Length), remembered per client header set: a client sends the same headers with every
        request but the length, and the adapter's answer depends on nothing else (the headers, the
        client's address, the scheme, its own settings: a reloaded tenant has a new adapter). Building
        them was ~6 us of a resident request's ~40 us of gate and listener Python. A new list each time."""
        adapter = self.adapter(tenant)
        sent = tuple(h for h in client_headers if h[0] != b"content-length")
        key = (tenant.name, sent, client_ip, scheme)
        known = self._unframed.get(key)
        if known is None or known[0] is not adapter:
            headers = adapter.upstream_headers(sent, client_ip=client_ip, scheme=scheme)
            known = remember(self._unframed, key, (adapter, [(k, v) for k, v in headers if k != b"content-length"]),
                             UNFRAMED_KEPT_MAX)
        return list(known[1])

    def relay(self, tenant: Tenant, upstream_response: UpstreamResponse, on_close: OnClose,
              *, tap: Tap | None = None, activity: Activity | None = None) -> Response:
        """A response that streams the upstream body and calls on_close exactly once at the end
        (and `activity` as each streamed chunk passes)."""
        return RelayResponse(upstream_response, on_close, tap, tenant.name, activity)

    async def get(self, tenant: Tenant, path: str) -> httpx.Response:
        """A small GET of the proxy's own (job polls), read fully."""
        client = self.client(tenant)
        return await client.get(f"{tenant.upstream}{path}", headers={"host": self.adapter(tenant).upstream_host})

    # -- websockets -----------------------------------------------------------------------
    async def websocket(self, tenant: Tenant, ws: WebSocket,
                        on_upstream_text: Callable[[str], bool] | None = None,
                        later: asyncio.Queue[str] | None = None) -> None:
        """Bridge a client websocket to the same path and query upstream, frames and close codes both ways.
        `on_upstream_text` sees each upstream text frame first; False: the frame is not relayed now
        (held back, or dropped); `later`: text frames relayed when they come (ones held back)."""
        adapter: HostAndHeaders = self.adapter(tenant)
        scope = ws.scope
        origin, extra = _ws_headers(adapter, ws)
        subprotocols = _ws_subprotocols(ws)
        try:
            upstream = await connect(
                _ws_uri(tenant, adapter, scope), origin=origin, additional_headers=extra,  # type: ignore[arg-type]
                user_agent_header=None, subprotocols=subprotocols or None, compression=None, proxy=None,
                open_timeout=tenant.timeouts.connect_s, ping_interval=None, ping_timeout=None,
                close_timeout=5, max_size=WS_MAX_SIZE, max_queue=64,
            )
        except websockets.InvalidStatus as exc:
            await _upstream_refused(tenant, ws, scope, exc)
            return
        except (TimeoutError, OSError, websockets.InvalidHandshake) as exc:
            await _refuse_open(tenant, ws, scope, exc)
            return
        async with upstream:
            await ws.accept(subprotocol=upstream.subprotocol)
            await self._bridge(ws, upstream, on_upstream_text, later)

    async def _bridge(self, ws: WebSocket, upstream: ClientConnection,
                      on_text: Callable[[str], bool] | None, later: asyncio.Queue[str] | None = None) -> None:
        sending = asyncio.Lock()  # frames relayed later never interleave with the stream's

        async def send_text(text: str) -> None:
            async with sending:
                await ws.send_text(text)

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
                        if on_text is None or on_text(frame):
                            await send_text(frame)
                    else:
                        async with sending:
                            await ws.send_bytes(frame)
            except websockets.ConnectionClosed:
                pass
            code = upstream.close_code if upstream.close_code is not None else 1011
            reason = upstream.close_reason or ""
            if ws.client_state != WebSocketState.DISCONNECTED and ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                    await ws.close(_sendable(code), reason)

        async def later_to_client() -> None:
            assert later is not None
            while True:
                await send_text(await later.get())

        tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
        if later is not None:
            tasks.append(asyncio.create_task(later_to_client()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
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
            pools.relay.close()
            await pools.client.aclose()


def _sendable(code: int) -> int:
    # 1005 (no code) and 1006 (abnormal) are reserved: they may not appear in a close frame.
    if code == 1005:
        return 1000
    if code in (1006, 1015) or code < 1000:
        return 1011
    return code


def _ws_headers(adapter: HostAndHeaders, ws: WebSocket) -> tuple[str | None, list[tuple[str, str]]]:
    """The upstream handshake's Origin and its other headers (Host and Origin are the client library's
    to send; the client's User-Agent kept)."""
    headers = _latin1(adapter.upstream_headers(
        ws.headers.raw, client_ip=ws.client.host if ws.client else None, scheme=ws.scope.get("scheme", "ws"),
        websocket=True))
    origin = next((v for k, v in headers if k.lower() == "origin"), None)
    extra = [(k, v) for k, v in headers if k.lower() not in ("host", "origin")]
    ua = ws.headers.get("user-agent")
    if ua:
        extra.append(("User-Agent", ua))
    return origin, extra


def _ws_subprotocols(ws: WebSocket) -> list[Subprotocol]:
    """The subprotocols the client offered, passed on as offered."""
    offered = ws.headers.get("sec-websocket-protocol", "").split(",")
    return [Subprotocol(p.strip()) for p in offered if p.strip()]


def _ws_uri(tenant: Tenant, adapter: HostAndHeaders, scope: Scope) -> str:
    """The upstream websocket's address: ws or wss as the tenant's upstream is http or https, the
    adapter's host, the client's raw path and query."""
    base = httpx.URL(tenant.upstream or "")
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    query: bytes = scope.get("query_string", b"")
    return (("wss" if base.scheme == "https" else "ws") + "://" + adapter.upstream_host
            + raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""))


async def _upstream_refused(tenant: Tenant, ws: WebSocket, scope: Scope, exc: websockets.InvalidStatus) -> None:
    """The upstream answered the handshake with a status: the client gets that answer where the server
    can send a denial response, else a policy-violation close (1008)."""
    status = exc.response.status_code
    log.info("%s: upstream refused websocket %s with %d", tenant.name, scope["path"], status)
    await ws.send_denial_response(Response(bytes(exc.response.body or b""), status_code=status)) \
        if "websocket.http.response" in scope.get("extensions", {}) else await ws.close(1008)


async def _refuse_open(tenant: Tenant, ws: WebSocket, scope: Scope, exc: Exception) -> None:
    """The upstream websocket could not be opened: the client gets the status an HTTP/1.0 app refused
    the upgrade with (and why), else the proxy's 502/504 naming the failure."""
    if (status := _http10_refusal(exc)) is not None:
        log.info("%s: upstream refused websocket %s with HTTP/1.0 %d", tenant.name, scope["path"], status)
        body: Mapping[str, object] = {
            "error": f"{tenant.name} answered the websocket upgrade of {scope['path']} with HTTP/1.0 {status}: it "
                     "serves no websocket there", "tenant": tenant.name,
            "fix": f"check the path, or whether {tenant.name} offers websockets at all"}
        code = 1008
    else:
        log.warning("%s: cannot open upstream websocket: %s", tenant.name, exc)
        err = upstream_error(tenant, exc if not isinstance(exc, asyncio.TimeoutError) else httpx.ConnectTimeout(str(exc)))
        status, body, code = err.status, err.body(), 1011
    if "websocket.http.response" in scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(body, status_code=status))
    else:
        await ws.close(code)


_HTTP10_STATUS = re.compile(r"expected HTTP/1\.1: HTTP/1\.0 ([1-5]\d\d)\b")


def _http10_refusal(exc: BaseException) -> int | None:
    """An app that speaks HTTP/1.0 (Python's http.server, a small WebUI) answers an upgrade with its
    own status line, which the websockets client cannot parse (it expects HTTP/1.1): that status, so
    the client gets the app's refusal, not a 502 as if the app were down. None: another failure."""
    cause = exc.__cause__
    found = _HTTP10_STATUS.search(str(cause)) if isinstance(exc, websockets.InvalidMessage) and cause else None
    return int(found.group(1)) if found is not None and int(found.group(1)) >= 400 else None
