"""A tenant's listener: a drop-in for the engine on its own port, every method and path, plus websockets.

GPU requests (per the engine adapter) are read up to `replay_body_max_bytes` so admission can plan
and retry once after an OOM, counted in flight, then relayed; everything else streams straight.
Tenant listeners never expose admin routes: every path belongs to the engine.

The listener is a bare ASGI callable, not a Starlette app: every path and method belongs to the
engine, so Route matching, the middleware stack and a Request per passthrough request were pure
cost (bench: ~0.3 ms of the proxy's added latency per small GET). A passthrough GET nothing watches
is run by the listener's protocol itself when it can (`start_inline`, proxy/relay/inline.py): no
ASGI task at all.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from proxy.config.schema import Tenant
from proxy.engines import strip_hop_by_hop
from proxy.engines.base import origin_netloc, same_origin
from proxy.engines.ports import JobView, ListenerPorts, Streamed
from proxy.errors import HyperSwapError
from proxy.handoff.inflight import InFlight, JobFate, JobPoller, Token
from proxy.memo import remember
from proxy.relay import progress
from proxy.relay.departure import ClientLink, Sweep, has_body
from proxy.relay.forward import Forwarder, UpstreamResponse, upstream_error
from proxy.relay.gpu_gate import FirstStep, GpuGate, request_path
from proxy.relay.guards import SAFE_METHODS, answer, host_header, refuse_tenant_host
from proxy.relay.inbound import GuardedHttpProtocol, Inline, InlineHead
from proxy.relay.inline import InlineExchange, InlineLane
from proxy.relay.trace import Trace, stamp, traced
from proxy.relay.trace import current as current_trace

log = logging.getLogger("hyperswap.listener")


Wake = Callable[[], Awaitable["Response | None"]]  # start a tenant that sleeps; its refusal, or None: go on

JOB_RESPONSE_MAX = 1 << 20  # a POST /prompt answer is tiny; never hold more than this
NEWS_MAX = 4 << 20  # a model list or a pull's request, kept for the adapter: never more than this
INLINE_ROUTES_MAX = 256  # paths whose inline answer a listener remembers; a flood of new ones only misses
INLINE_HEADS_MAX = 256  # request heads whose upstream bytes a listener remembers (`start_inline`)
INLINE_HEAD_KEY_MAX = 2048  # the largest head (target and header bytes) remembered: at most ~0.5 MiB in all
_UNSEEN = object()


async def _read_up_to(request: Request, limit: int) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """The whole body if it fits in `limit`, else (prefix, iterator yielding prefix then the rest).
    Read from the request's `receive` as Starlette's `Request.stream()` reads it (a client that leaves
    raises ClientDisconnect), without its generator: the usual body is one message."""
    declared = _header(request.scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return b"", request.stream()
    receive = request.receive
    parts: list[bytes] = []
    size = 0
    while True:
        chunk, more = await _next_part(receive)
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return b"", _again(parts, _rest(receive) if more else None)
        if not more:
            return b"".join(parts), None


async def _next_part(receive: Receive) -> tuple[bytes, bool]:
    """The next part of a request's body and whether more follows; a client that left raises
    ClientDisconnect (what Starlette's `Request.stream()` does, message by message)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if message["type"] == "http.request":
            return message.get("body", b""), message.get("more_body", False)


def _header(scope: Scope, name: bytes) -> str | None:
    """A request header's first value, as Starlette's `request.headers.get` reads it (`name` lower-case,
    as ASGI hands the names over), without building its Headers."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


def _address(server: GuardedHttpProtocol) -> str | None:
    """The client's address on this connection (None: not known, as for a Unix socket)."""
    client = server.client
    return client[0] if client else None


async def _rest(receive: Receive) -> AsyncIterator[bytes]:
    """What is left of a body being read from `receive`."""
    while True:
        chunk, more = await _next_part(receive)
        if chunk:
            yield chunk
        if not more:
            return


async def _again(read: list[bytes], stream: AsyncIterator[bytes] | None) -> AsyncIterator[bytes]:
    """A body of which `read` was read already: those chunks, then the rest of `stream` (None: no more)."""
    for part in read:
        yield part
    if stream is not None:
        async for more in stream:
            yield more


PROGRESS_HEADER = progress.HEADER.lower().encode("latin-1")
HEAD_BYTES = 64 * 1024  # what is read of a body too large to keep, to find the model it names


async def _head_of(stream: AsyncIterator[bytes], limit: int) -> tuple[bytes, AsyncIterator[bytes]]:
    """The first `limit` bytes (or so) of a body, and an iterator of the whole body, head included."""
    parts: list[bytes] = []
    size = 0
    async for chunk in stream:
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit], _again(parts, stream)


def _decoded(body: bytes, encoding: str) -> bytes:
    """ComfyUI may gzip JSON (--enable-compress-response-body); the client still gets the raw bytes."""
    try:
        if encoding in ("gzip", "x-gzip"):
            return zlib.decompress(body, 16 + zlib.MAX_WBITS)
        if encoding == "deflate":
            return zlib.decompress(body)
    except zlib.error:
        return b""
    return body if not encoding or encoding == "identity" else b""


@dataclass(frozen=True, slots=True)
class KnownRead:
    """A read that was, byte for byte, a GET this listener ran inline: for whom and over what scheme,
    what went upstream, and the request (for the scope of a task that takes over)."""

    client: str | None
    scheme: str | None  # one app serves one listener, but what went upstream says it (X-Forwarded-Proto)
    upstream: bytes
    request: InlineHead


class TenantApp:
    """The ASGI app of one tenant listener: Host check, then every path to the engine, GPU requests
    through the admission hook, websockets relayed with their frames watched. `poller` is the
    tenant's job poller (jobs the engine runs after its answer, for clients with no websocket)."""

    def __init__(self, tenant: Tenant, forwarder: Forwarder, inflight: InFlight, gate: GpuGate | None = None,
                 *, job_poll_s: float = 1.0) -> None:
        self.tenant = tenant
        self.forwarder = forwarder
        self.inflight = inflight
        self.gate = gate
        self.adapter: ListenerPorts = forwarder.adapter(tenant)
        self._hosts = self.adapter.host_policy()
        # a tenant the proxy may stop, or whose release owes a resume: woken before each request
        self._sleeps = tenant.lifecycle is not None or any(s.resumes for s in tenant.release_steps)
        self.poller = JobPoller(inflight, tenant.name, self._check_jobs, interval_s=job_poll_s, on_lost=self._job_lost)
        self._departures = Sweep()  # starts the departure watch of the requests that last
        self._inline_routes: dict[str, bool] = {}  # path -> a GET of it is a passthrough nothing watches
        self._inline_heads: dict[object, bytes | object | None] = {}  # request head -> its upstream head, or None
        self._known_reads: dict[bytes, KnownRead] = {}  # a read that was a GET run inline -> how to run it again
        self._lane = InlineLane(again=self, relay_opened=self._relay_opened, failed=self._failed,
                                ended=partial(inflight.connection_closed, tenant.name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind in ("http", "websocket"):
            # Before anything reaches the engine: it gets its own Host from us and can no longer check.
            host = host_header(scope)
            if host is None or not self._hosts.allows(host):
                await refuse_tenant_host(scope, receive, send, self.tenant.name, host)
                return
        if kind == "http":
            name = self.tenant.name
            self.inflight.connection_opened(name)  # a stop never cuts it (TenantLifecycle)
            try:
                await self._http(scope, receive, send)
            finally:
                self.inflight.connection_closed(name)
        elif kind == "websocket":
            with self.inflight.connection(self.tenant.name):
                refusal = await self._wake(scope) if self._sleeps else None
                if refusal is not None:
                    await answer(scope, receive, send, refusal)
                    return
                await self._websocket(WebSocket(scope, receive, send))
        elif kind == "lifespan":  # nothing to start: answer so a server with lifespan on proceeds
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # -- HTTP ------------------------------------------------------------------------------------
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        link = ClientLink(scope, receive)
        link.watch(self._departures)
        try:
            gpu = self.adapter.classify(scope["method"], scope["path"]) != "passthrough"
            if not gpu and not self._sleeps:  # nothing on its way waits or is timed: no trace to keep
                response = await self._passthrough(scope, link)
                await response(scope, link.receive, send)
                return
            trace = Trace()
            with traced(trace):  # where the time went before the answer: Server-Timing, progress lines
                if gpu and self._sleeps and self.gate is not None and self.gate.dormant(self.tenant):
                    # its body is read first: a streamed one is answered while the app starts, and hears it
                    response = await self._gpu(Request(scope, link.receive), wake=partial(self._wake, scope))
                else:
                    refusal = await self._wake(scope) if self._sleeps else None
                    if refusal is not None:
                        response = refusal
                    elif not gpu:
                        response = await self._passthrough(scope, link)
                    else:
                        response = await self._gpu(Request(scope, link.receive))
                stamp(response.raw_headers, trace)
                await response(scope, link.receive, send)
        except asyncio.CancelledError:
            if not link.absorb_cancel():
                raise
            log.debug("%s: client left %s %s; upstream request closed", self.tenant.name, scope["method"], scope["path"])
        except ClientDisconnect:
            log.debug("%s: client left while sending the body of %s %s", self.tenant.name, scope["method"], scope["path"])
        finally:
            link.close()

    # -- a passthrough GET run by the listener's protocol (inline.py) ------------------------------
    def start_inline(self, server: GuardedHttpProtocol, target: bytes, headers: list[tuple[bytes, bytes]],
                     http_version: str) -> InlineExchange | None:
        """Run a GET's exchange without a task (the listener's protocol asks, with the head as parsed)
        when it is a passthrough nothing watches on a tenant that never sleeps, and an idle connection
        to its upstream is there; None: serve it as ever."""
        if self._sleeps:
            return None
        key = (target, tuple(headers), _address(server), server.scheme)
        head = self._inline_heads.get(key, _UNSEEN)
        if head is _UNSEEN:
            head = self._inline_head(server.request_scope("GET", http_version, target, headers))
            if len(target) + sum(len(n) + len(v) for n, v in headers) <= INLINE_HEAD_KEY_MAX:
                remember(self._inline_heads, key, head, INLINE_HEADS_MAX)
        if not isinstance(head, bytes):
            return None  # None: not run inline
        return self._run_inline(server, head, (target, headers, http_version), known=False)

    def start_read(self, server: GuardedHttpProtocol, data: bytes) -> InlineExchange | None:
        """Run again, with no parse, a read that was byte for byte a GET this listener ran inline
        (`learn_read`), for the same client address, when an idle upstream connection is there."""
        known = self._known_reads.get(data)
        if known is None or known.client != _address(server) or known.scheme != server.scheme:
            return None
        return self._run_inline(server, known.upstream, known.request, known=True)

    def _run_inline(self, server: GuardedHttpProtocol, upstream: bytes, request: InlineHead, *,
                    known: bool) -> InlineExchange | None:
        """Send `upstream` (the request's head as it goes upstream) on an idle pooled connection, its
        answer to an inline exchange on the connection's `lane_cycle`; None: no idle connection.
        `known`: a known read (`start_read`), served unparsed."""
        exchange = self.forwarder.send_now(self.tenant, upstream, lambda conn: InlineExchange(
            server, server.lane_cycle(request[2], known=known), conn, self._lane, request, upstream))
        if exchange is not None:
            self.inflight.connection_opened(self.tenant.name)  # a stop never cuts it (TenantLifecycle)
        return exchange

    def learn_read(self, server: GuardedHttpProtocol, data: bytes, exchange: Inline) -> None:
        """`data`, one read, was all of the GET `exchange` runs inline. A kept-alive HTTP/1.1 GET with no
        Expect is remembered by its bytes (bounded), so the next one is served unparsed: its head was
        checked (limits, Host) and rewritten once, and the same bytes parse the same way."""
        if not isinstance(exchange, InlineExchange) or len(data) > INLINE_HEAD_KEY_MAX:
            return
        cycle = server.cycle
        target, headers, version = exchange.request
        if version != "1.1" or cycle is None or not cycle.keep_alive or cycle.waiting_for_100_continue:
            return
        remember(self._known_reads, data, KnownRead(_address(server), server.scheme, exchange.upstream,
                                                    (target, tuple(headers), version)), INLINE_HEADS_MAX)

    def _inline_head(self, scope: Scope) -> bytes | None:
        """What a GET with this head sends upstream when it can be run inline; None: it cannot (a body,
        a Host this listener refuses, a path the adapter watches). It depends on the head alone (target,
        headers, the client's address and the scheme): `start_inline` remembers it per head, so
        a client that polls one URL pays for the header rewrite once (a listener's tenant, adapter and
        Host policy are fixed for its life)."""
        if has_body(scope):
            return None
        host = host_header(scope)
        if host is None or not self._hosts.allows(host) or not self._inline_route(scope["path"]):
            return None
        return self.forwarder.inline_head(self.tenant, scope)

    def _inline_route(self, path: str) -> bool:
        """Whether a GET of this path is a passthrough no adapter question watches (model news, job
        news, job views): the adapter's four answers, which depend on the method and path only,
        remembered per path (four calls, each lowering the method and trimming the path, per request)."""
        known = self._inline_routes.get(path)
        if known is None:
            adapter = self.adapter
            known = remember(self._inline_routes, path, adapter.classify("GET", path) == "passthrough"
                             and not adapter.model_news("GET", path) and not adapter.job_news("GET", path)
                             and adapter.job_view("GET", path) is None, INLINE_ROUTES_MAX)
        return known

    def _relay_opened(self, upstream: UpstreamResponse) -> ASGIApp:
        """The ASGI app that relays an inline exchange's open answer as `_http` relays a passthrough one."""
        async def relay(scope: Scope, receive: Receive, send: Send) -> None:
            link = ClientLink(scope, receive)
            link.watch(self._departures)
            try:
                await self.forwarder.relay(self.tenant, upstream, on_close=_nothing)(scope, link.receive, send)
            except asyncio.CancelledError:
                if not link.absorb_cancel():
                    raise
                log.debug("%s: client left %s %s; upstream request closed", self.tenant.name, scope["method"],
                          scope["path"])
            finally:
                link.close()
                upstream.close()
        return relay

    def _failed(self, exc: Exception) -> ASGIApp:
        """The ASGI app that answers an inline exchange whose upstream failed, as `Forwarder.open` would."""
        return _error_response(upstream_error(self.tenant, exc))

    async def _passthrough(self, scope: Scope, link: ClientLink) -> Response:
        if self.adapter.model_news(scope["method"], scope["path"]):
            return await self._model_news(scope, link)
        try:
            upstream = await self.forwarder.open(self.tenant, scope, link.body())
        except HyperSwapError as exc:
            return _error_response(exc)
        news = self.adapter.job_news(scope["method"], scope["path"]) and self.inflight.jobs(self.tenant.name)
        # a queue delete or clear, or a client that polls for its job's end: check the jobs now
        on_close = self.poller.check_soon if news else _nothing
        view = self.adapter.job_view(scope["method"], scope["path"])
        if view is not None and self.gate is not None and upstream.status_code == 200 \
                and self.gate.watches_views(self.tenant):
            return await self._client_view(upstream, self.gate, view, on_close)
        return self.forwarder.relay(self.tenant, upstream, on_close=on_close)

    async def _client_view(self, upstream: UpstreamResponse, gate: GpuGate, kind: JobView,
                           on_close: Callable[[], None]) -> Response:
        """The engine's history or queue as the client must see it: a job retried after an OOM is not
        finished until its new run is (its failed run's record left out), and queued while its retry is
        decided; relayed unchanged when nothing changes."""
        try:
            raw = await upstream.aread()
        finally:
            await upstream.aclose()
            on_close()
        encoding = upstream.headers.get("content-encoding", "").strip().lower()
        view = gate.client_view(self.tenant, kind, _decoded(raw, encoding))
        headers = [(k, v) for k, v in strip_hop_by_hop(upstream.raw_headers) if k.lower() != b"content-length"
                   and (view is None or k.lower() != b"content-encoding")]
        body = raw if view is None else view
        response = Response(body, status_code=upstream.status_code)
        response.raw_headers = [*headers, (b"content-length", b"%d" % len(body))]
        return response

    async def _model_news(self, scope: Scope, link: ClientLink) -> Response:
        """A request that changes what a model name is, or lists the models (the adapter's `model_news`):
        relayed as ever, its body and answer (up to NEWS_MAX each) kept for the adapter, told when the
        answer ends."""
        method, path = scope["method"], scope["path"]
        asked = _Kept()
        body = link.body()
        try:
            upstream = await self.forwarder.open(self.tenant, scope, body if isinstance(body, bytes)
                                                 else asked.through(body))
        except HyperSwapError as exc:
            return _error_response(exc)
        if isinstance(body, bytes):
            asked.tap(body)
        answer = _Kept()
        status = upstream.status_code
        encoding = upstream.headers.get("content-encoding", "").strip().lower()

        def on_close() -> None:
            self.adapter.saw_model_news(method, path, asked.value(), status, _decoded(answer.value(), encoding))

        return self.forwarder.relay(self.tenant, upstream, on_close=on_close, tap=answer.tap)

    async def _gpu(self, request: Request, wake: Wake | None = None) -> Response:
        """A request that may load something: counted in flight from its admission (never while it
        waits for memory) until its answer ends (a job the engine runs after answering, until that
        job ends). `wake`: its tenant sleeps; woken before anything else (inside a streamed request's
        progress answer, so the client hears the app start)."""
        tenant, forwarder, inflight = self.tenant, self.forwarder, self.inflight
        method, path = request.method, request_path(request)
        token = inflight.begin(tenant.name, admitted=self.gate is None)
        try:
            body, rest = await _read_up_to(request, tenant.replay_body_max_bytes)
            if rest is not None:
                refusal = await wake() if wake is not None else None  # its app still starts first
                if refusal is not None:
                    inflight.end(token, refusal.status_code)
                    return refusal
                result: UpstreamResponse | Response = await self._unkept(request, rest, token)
            elif self.gate is not None:
                streamed = self._progress_for(request, body)
                if wake is not None:
                    if streamed is not None:
                        return self._progress(request, body, token, streamed, (None, None), wake)
                    refusal = await wake()
                    if refusal is not None:
                        inflight.end(token, refusal.status_code)
                        return refusal
                # a load on the card never waits: admitted at once, it needs no progress answer around it
                first: FirstStep = (None, None)
                if streamed is not None:
                    first = await self.gate.at_once(tenant, request, body, token)
                    if first[1] is None:
                        return self._progress(request, body, token, streamed, first)
                result = await self.gate.handle(tenant, request, body,
                                                     lambda b: forwarder.open(tenant, request, b), token, first)
            else:
                result = await forwarder.open(tenant, request, body)
        except HyperSwapError as exc:
            inflight.end(token, exc.status)
            return _error_response(exc)
        except BaseException:
            inflight.end(token)
            raise
        if body and not isinstance(result, Response):
            self.adapter.saw_gpu_answer(path, body, result.status_code)
        return self._answer(result, token, method, path)

    async def _unkept(self, request: Request, rest: AsyncIterator[bytes], token: Token) -> UpstreamResponse | Response:
        """A body too large to keep for an OOM retry: still planned, on what its head names (one door),
        then streamed to the engine as it arrives."""
        tenant, forwarder = self.tenant, self.forwarder
        log.info("%s: %s %s body exceeds replay_body_max_mb=%s: planned on its head, streamed, no OOM retry",
                 tenant.name, request.method, request_path(request), tenant.replay_body_max_mb)
        if self.gate is None:
            self.inflight.admit(token)
            return await forwarder.open(tenant, request, rest)
        head, whole = await _head_of(rest, HEAD_BYTES)
        return await self.gate.handle_unkept(tenant, request, head, lambda: forwarder.open(tenant, request, whole),
                                                  token)

    def _answer(self, result: UpstreamResponse | Response, token: Token, method: str, path: str) -> Response:
        """The answer to an admitted GPU request, counted in flight until it ends."""
        inflight = self.inflight
        if isinstance(result, Response):
            inflight.end(token, result.status_code)
            return result
        status = result.status_code
        if not self.adapter.captures_job(method, path):
            return self.forwarder.relay(self.tenant, result, on_close=lambda: inflight.end(token, status),
                                        activity=partial(inflight.active, self.tenant.name))
        return self._relay_job_answer(result, token)

    def _progress_for(self, request: Request, body: bytes) -> Streamed | None:
        """A streamed request that gets progress lines if it must wait: the engine streams its answer,
        and the request's X-HyperSwap-Progress header (on/off), else the tenant's `progress`, asks."""
        if self.gate is None or not progress.wanted(self.tenant.progress, _header(request.scope, PROGRESS_HEADER)):
            return None
        return self.adapter.stream_format(request_path(request), body)

    def _progress(self, request: Request, body: bytes, token: Token, streamed: Streamed, first: FirstStep,
                  wake: Wake | None = None) -> Response:
        """Admission (with the need `first` found) and forward run inside the answer, which starts as
        soon as the plan says the request waits or its app starts (`wake`, first: proxy/relay/progress.py);
        one that does not wait is answered as ever."""
        gate, tenant, forwarder, inflight = self.gate, self.tenant, self.forwarder, self.inflight
        assert gate is not None
        changed = asyncio.Event()
        unwatch = gate.watch_waits(changed.set)
        method, path = request.method, request_path(request)

        def answer(result: UpstreamResponse | Response) -> Response:
            unwatch()
            if not isinstance(result, Response):
                self.adapter.saw_gpu_answer(path, body, result.status_code)
            return self._answer(result, token, method, path)

        def finish(status: int | None) -> None:
            unwatch()
            inflight.end(token, status)

        async def run() -> UpstreamResponse | Response:
            if wake is not None and (refusal := await wake()) is not None:
                return refusal  # not started: the refusal (a 503 with the app's last lines, a 507)
            return await gate.handle(tenant, request, body, lambda b: forwarder.open(tenant, request, b), token,
                                          first)

        return progress.ProgressResponse(
            streamed, run,
            lambda: gate.wait_of(token), changed, current_trace() or Trace(), gate.clock, answer, finish,
            activity=partial(inflight.active, tenant.name))

    def _relay_job_answer(self, result: UpstreamResponse, token: Token) -> Response:
        """Relay the answer that names a job (ComfyUI's prompt id), reading the id off it as it passes;
        the job is tracked before the request stops counting, so the tenant never looks idle between."""
        seen: list[bytes] = []
        size = [0]
        status = result.status_code
        encoding = result.headers.get("content-encoding", "").strip().lower()

        def tap(chunk: bytes) -> None:
            if size[0] + len(chunk) <= JOB_RESPONSE_MAX:
                seen.append(chunk)
            size[0] += len(chunk)

        def on_close() -> None:
            try:
                job_id = self.adapter.job_id_from_response(status, _decoded(b"".join(seen), encoding))
                if job_id is not None and self.inflight.track_job(self.tenant.name, job_id):
                    self.poller.ensure_running()
            finally:
                self.inflight.end(token, status)

        return self.forwarder.relay(self.tenant, result, on_close=on_close, tap=tap,
                                    activity=partial(self.inflight.active, self.tenant.name))

    async def _wake(self, scope: Scope) -> Response | None:
        """A read (GET, HEAD, OPTIONS) starts a stopped app only when its wake_on says "any"; a
        websocket is no read (a session someone opened); a foreign browser Origin never starts it."""
        if self.gate is None:
            return None
        method = scope.get("method")  # a websocket's scope has none
        reads_only = (method in SAFE_METHODS and self.tenant.lifecycle is not None
                      and self.tenant.wake_on == "writes")
        return await self.gate.wake(self.tenant, f"{method or 'websocket'} {scope['path']}",
                                         reads_only=reads_only, origin=self._foreign_origin(scope))

    def _foreign_origin(self, scope: Scope) -> str | None:
        """The Origin a browser sent, when it is neither this listener's own address nor a name the
        listener answers (loopback, allowed_hosts): a page elsewhere that must not start the app."""
        origin = _header(scope, b"origin")
        if origin is None or same_origin(origin, host_header(scope) or "", scope.get("scheme", "http")):
            return None
        netloc = origin_netloc(origin)
        return None if netloc is not None and self._hosts.allows(netloc) else origin

    # -- jobs ------------------------------------------------------------------------------------
    async def _websocket(self, ws: WebSocket) -> None:
        """Relay a websocket with its frames watched: a job's end, and through the admission's filter
        the frames of a job retried after an OOM (held back while the retry is decided, relayed later
        on the `later` queue if it is not)."""
        gate = self.gate
        if gate is None:
            await self.forwarder.websocket(self.tenant, ws, on_upstream_text=self._on_text)
            return
        later: asyncio.Queue[str] = asyncio.Queue()
        frames = gate.frames(self.tenant, later.put_nowait)

        def on_text(text: str) -> bool:
            verdict = frames.upstream(text)
            self._on_text(text, ends_job=verdict.ends_job)
            return verdict.send

        try:
            await self.forwarder.websocket(self.tenant, ws, on_upstream_text=on_text, later=later)
        finally:
            gate.unwatch(frames)

    def _on_text(self, text: str, *, ends_job: bool = True) -> bool:
        job_id = self.adapter.job_done_from_frame(text) if ends_job else None
        if job_id is not None:
            self.inflight.finish_job(self.tenant.name, job_id)
        if self.gate is not None:
            self.gate.on_frame(self.tenant, text)
        return True

    async def _check_jobs(self, job_ids: tuple[str, ...]) -> dict[str, JobFate]:
        """Each job's fate from the engine's own queue and history: a job in neither has been deleted
        or lost with a restarted engine. Read the queue first: a job that ends meanwhile is then in
        the history (ComfyUI writes it as it drops the job from the queue)."""
        tenant, adapter = self.tenant, self.adapter
        queued: frozenset[str] | None = None
        queue_path = adapter.queue_path()
        if queue_path is not None:
            resp = await self.forwarder.get(tenant, queue_path)
            queued = adapter.job_ids_from_queue(resp.status_code, resp.content)
        fates: dict[str, JobFate] = {}
        for job_id in job_ids:
            path = adapter.history_path(job_id)
            if path is None:
                continue
            resp = await self.forwarder.get(tenant, path)
            content = resp.content  # as the client sees it: a retried job's failed run is not its end
            if self.gate is not None and resp.status_code == 200:
                content = self.gate.history_view(tenant, content) or content
            if adapter.job_done_from_history(job_id, resp.status_code, content):
                fates[job_id] = "done"
                if self.gate is not None:
                    self.gate.on_job_end(tenant, job_id, content)
            elif self.gate is not None and self.gate.retry_deciding(tenant, job_id):
                fates[job_id] = "running"  # it ran out of memory and is about to run again
            elif resp.status_code == 200 and queued is not None and job_id not in queued:
                fates[job_id] = "lost"
            else:
                fates[job_id] = "running"
        return fates

    def _job_lost(self, job_id: str) -> None:
        if self.gate is not None:
            self.gate.on_job_lost(self.tenant, job_id)


class _Kept:
    """The first NEWS_MAX bytes of a body as it passes; b"" when it was longer (never half of one)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def tap(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size <= NEWS_MAX:
            self._parts.append(chunk)

    async def through(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.tap(chunk)
            yield chunk

    def value(self) -> bytes:
        return b"".join(self._parts) if self._size <= NEWS_MAX else b""


def _error_response(exc: HyperSwapError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


def _nothing() -> None:
    pass
