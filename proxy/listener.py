"""A tenant's listener: a drop-in for the engine on its own port, every method and path, plus websockets.

GPU requests (per the engine adapter) are read up to `replay_body_max_bytes` so admission can plan
and retry once after an OOM, counted in flight, then relayed; everything else streams straight.
Tenant listeners never expose admin routes: every path belongs to the engine.
"""

from __future__ import annotations

import logging
import zlib
from typing import AsyncIterator, Awaitable, Callable, Protocol

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from .errors import HyperSwapError
from .forward import Forwarder
from .inflight import InFlight, JobPoller
from .tenants import Tenant

log = logging.getLogger("hyperswap.listener")

METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
           "PROPFIND", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "PROPPATCH", "QUERY"]
JOB_RESPONSE_MAX = 1 << 20  # a POST /prompt answer is tiny; never hold more than this


class Admission(Protocol):
    async def handle(self, tenant: Tenant, request: Request, body: bytes,
                     forward: Callable[[bytes], Awaitable[httpx.Response]]) -> httpx.Response | Response: ...


async def _read_up_to(request: Request, limit: int) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """The whole body if it fits in `limit`, else (prefix, iterator yielding prefix then the rest)."""
    declared = request.headers.get("content-length")
    stream = request.stream()
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return b"", stream
    parts: list[bytes] = []
    size = 0
    async for chunk in stream:
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            async def rest(head: list[bytes] = parts) -> AsyncIterator[bytes]:
                for part in head:
                    yield part
                async for more in stream:
                    yield more
            return b"", rest()
    return b"".join(parts), None


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


def tenant_app(tenant: Tenant, forwarder: Forwarder, inflight: InFlight, admission: Admission | None = None,
               *, job_poll_s: float = 1.0) -> Starlette:
    adapter = forwarder.adapter(tenant)
    name = tenant.name

    async def check_job(job_id: str) -> bool:
        return await forwarder.job_done(tenant, job_id)

    poller = JobPoller(inflight, name, check_job, interval_s=job_poll_s)

    def error_response(exc: HyperSwapError) -> Response:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    async def http(request: Request) -> Response:
        method, path = request.method, request.url.path
        if adapter.classify(method, path) == "passthrough":
            try:
                upstream = await forwarder.open(tenant, request, request.stream())
            except HyperSwapError as exc:
                return error_response(exc)
            return forwarder.relay(tenant, upstream, on_close=lambda: None)

        token = inflight.begin(name)
        try:
            body, rest = await _read_up_to(request, tenant.replay_body_max_bytes)
            if rest is not None:
                log.info("%s: %s %s body exceeds replay_body_max_mb=%s: streamed without admission",
                         name, method, path, tenant.replay_body_max_mb)
                result: httpx.Response | Response = await forwarder.open(tenant, request, rest)
            elif admission is not None:
                result = await admission.handle(tenant, request, body,
                                                lambda b: forwarder.open(tenant, request, b))
            else:
                result = await forwarder.open(tenant, request, body)
        except HyperSwapError as exc:
            inflight.end(token)
            return error_response(exc)
        except BaseException:
            inflight.end(token)
            raise
        if isinstance(result, Response):
            inflight.end(token)
            return result

        if not adapter.captures_job(method, path):
            return forwarder.relay(tenant, result, on_close=lambda: inflight.end(token))

        seen: list[bytes] = []
        size = [0]
        status = result.status_code
        encoding = result.headers.get("content-encoding", "").strip().lower()

        def tap(chunk: bytes) -> None:
            if size[0] + len(chunk) <= JOB_RESPONSE_MAX:
                seen.append(chunk)
            size[0] += len(chunk)

        def on_close() -> None:
            # Track the job before the request stops counting, so the tenant never looks idle between.
            try:
                job_id = adapter.job_id_from_response(status, _decoded(b"".join(seen), encoding))
                if job_id is not None and inflight.track_job(name, job_id):
                    poller.ensure_running()
            finally:
                inflight.end(token)

        return forwarder.relay(tenant, result, on_close=on_close, tap=tap)

    def on_text(text: str) -> None:
        job_id = adapter.job_done_from_frame(text)
        if job_id is not None:
            inflight.finish_job(name, job_id)

    async def ws(websocket: WebSocket) -> None:
        await forwarder.websocket(tenant, websocket, on_upstream_text=on_text)

    routes: list[BaseRoute] = [
        WebSocketRoute("/{path:path}", ws),
        Route("/{path:path}", http, methods=METHODS),
    ]
    app = Starlette(routes=routes)
    app.state.poller = poller
    return app
