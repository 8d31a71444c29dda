"""Transparent forwarding through a tenant listener, against tiny upstreams that mimic the engine rules.

Real sockets on loopback. Ordering is pinned with events, never with timing: an upstream that waits
for the client to have seen line N before producing line N+1 deadlocks (and the safety timeout
fails the test) if the proxy buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import ipaddress
import json
import logging
import random
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import ollama
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.typing import Origin

from proxy.clock import ManualClock, until_all_wait
from proxy.config.schema import EngineKind, Tenant, Timeouts
from proxy.handoff.inflight import InFlight
from proxy.relay.forward import Forwarder
from proxy.relay.listener import TenantApp
from proxy.relay.servers import RunningServer, start_server
from proxy.tasks import poll_until
from tests.integration.boxes import LOOPBACK_TLS

SAFETY_S = 10.0  # only to turn a deadlock into a failure, never to measure


def _local_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name in ("", "localhost") or name.endswith((".localhost", ".local", ".internal")):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_unspecified


@dataclass
class Upstream:
    """State the test upstreams record and the events they wait on."""

    lines_seen: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(4)])
    upload_started: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    request_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    ws_closed_with: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    to_socket: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    history_done: set[str] = field(default_factory=set)
    last_headers: dict[str, str] = field(default_factory=dict)


def ollama_like(state: Upstream) -> Starlette:
    """Ollama's loopback Host rule and CORS same-origin rule (403, empty body), plus test routes."""

    async def echo(request: Request) -> Response:
        body = await request.body()
        state.last_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        return JSONResponse({"method": request.method, "path": request.url.path, "query": request.url.query,
                             "body": body.decode(), "headers": [[k, v] for k, v in request.headers.items()]})

    async def generate(request: Request) -> Response:
        await request.body()

        async def lines() -> AsyncIterator[bytes]:
            for i in range(4):
                done = i == 3
                yield (json.dumps({"model": "m", "created_at": "2026-12-02T00:00:00Z", "response": f"w{i}",
                                   "done": done, **({"done_reason": "stop"} if done else {})}) + "\n").encode()
                if not done:  # the next line only after the client has seen this one
                    await asyncio.wait_for(state.lines_seen[i].wait(), SAFETY_S)
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def sse(request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"data: {json.dumps({'i': i})}\n\n".encode()
                await asyncio.wait_for(state.lines_seen[i].wait(), SAFETY_S)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def ranged(request: Request) -> Response:
        data = bytes(range(256)) * 4
        rng = request.headers.get("range")
        if rng and rng.startswith("bytes="):
            start, end = (int(x) for x in rng[6:].split("-"))
            return Response(data[start:end + 1], status_code=206, media_type="application/octet-stream",
                            headers={"Content-Range": f"bytes {start}-{end}/{len(data)}"})
        return Response(data, media_type="application/octet-stream")

    async def gz(request: Request) -> Response:
        return Response(gzip.compress(b'{"ok": true}'), media_type="application/json",
                        headers={"Content-Encoding": "gzip"})

    async def blob(request: Request) -> Response:
        n = 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                state.upload_started.set()
        except ClientDisconnect:  # an aborted upload (the engine logs it and moves on)
            return Response(status_code=400)
        return JSONResponse({"received": n})

    async def forever(request: Request) -> Response:
        raise AssertionError("replaced by the raw ASGI route below")

    routes = [Route("/echo", echo, methods=["GET", "POST", "DELETE", "PUT"]),
              Route("/api/generate", generate, methods=["POST"]), Route("/v1/chat/completions", sse, methods=["POST"]),
              Route("/range", ranged), Route("/gz", gz), Route("/api/blobs/{d}", blob, methods=["POST"]),
              Route("/upload", blob, methods=["POST"])]
    inner = Starlette(routes=routes)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        host, origin = headers.get("host", ""), headers.get("origin")
        allowed = origin is None or origin in (f"http://{host}", f"https://{host}") or \
            urlsplit(origin).hostname in ("localhost", "127.0.0.1")
        if not _local_host(host) or not allowed:
            await send({"type": "http.response.start", "status": 403, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["path"] == "/forever":  # streams until the client goes away, and records that
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            state.disconnected.set()
            return
        if scope["path"] == "/silent":  # reads the request, then says nothing until the client goes away
            state.request_arrived.set()
            while (await receive())["type"] != "http.disconnect":
                pass
            state.disconnected.set()
            return
        if scope["path"] == "/early":  # answers before reading the body, then acks each part as it comes
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"started\n", "more_body": True})
            received = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                if message.get("body"):
                    received += len(message["body"])
                    await send({"type": "http.response.body", "body": b"got %d\n" % received, "more_body": True})
                if not message.get("more_body", False):
                    break
            await send({"type": "http.response.body", "body": b"end\n"})
            return
        await inner(scope, receive, send)

    return app  # type: ignore[return-value]


def comfyui_like(state: Upstream) -> Starlette:
    """ComfyUI's origin_only_middleware (loopback Host must equal Origin's host:port) and prompt flow."""
    counter = iter(range(1, 1000))

    async def prompt(request: Request) -> Response:
        body = await request.json()
        pid = body.get("prompt_id") or f"p{next(counter)}"
        return JSONResponse({"prompt_id": pid, "number": 0, "node_errors": {}})

    async def history(request: Request) -> Response:
        pid = request.path_params["pid"]
        return JSONResponse({pid: {"status": {"completed": True}}} if pid in state.history_done else {})

    async def plain(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text(json.dumps({"type": "status", "data": {"sid": websocket.query_params.get("clientId")}}))

        async def pump() -> None:
            while True:
                await websocket.send_text(await state.to_socket.get())

        pumper = asyncio.create_task(pump())
        try:
            while True:
                msg = await websocket.receive()
                if msg["type"] == "websocket.disconnect":
                    state.ws_closed_with.set_result(msg.get("code", 1000)) if not state.ws_closed_with.done() else None
                    return
                if msg.get("bytes") is not None:
                    await websocket.send_bytes(msg["bytes"][::-1])
                elif msg["text"].startswith("close:"):
                    await websocket.close(int(msg["text"][6:]), reason="asked")
                    return
                else:
                    await websocket.send_text("echo:" + msg["text"])
        finally:
            pumper.cancel()

    inner = Starlette(routes=[Route("/prompt", prompt, methods=["POST"]), Route("/api/prompt", prompt, methods=["POST"]),
                              Route("/history/{pid}", history), Route("/", plain), WebSocketRoute("/ws", ws)])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        host, origin = headers.get("host", "").lower(), headers.get("origin")
        if origin is not None and _local_host(host):
            o = urlsplit(origin)
            origin_domain = (o.netloc or "").lower()
            host_domain = host if o.port else host.rsplit(":", 1)[0]
            if ":" not in host:
                origin_domain = (o.hostname or "").lower()
            if host_domain != origin_domain:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})  # uvicorn answers 403
                    return
                await send({"type": "http.response.start", "status": 403, "headers": [(b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
                return
        await inner(scope, receive, send)

    return app  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def stack(engine: EngineKind, upstream_app: Callable[[Upstream], Starlette] | None, *, upstream_url: str | None = None,
                clock: ManualClock | None = None, max_connections: int = 1024,
                **tenant_fields: Any) -> AsyncIterator[tuple[RunningServer, Tenant, InFlight, Upstream]]:
    state = Upstream()
    servers: list[RunningServer] = []
    forwarder = Forwarder(max_connections=max_connections)
    try:
        if upstream_app is not None:
            up = await start_server(upstream_app(state), name="upstream")
            servers.append(up)
            upstream_url = up.url
        tenant = Tenant(name=engine, engine=engine, upstream=upstream_url, **tenant_fields)
        inflight = InFlight(clock or ManualClock())
        proxy = await start_server(TenantApp(tenant, forwarder, inflight, job_poll_s=0.01), name="proxy")
        servers.append(proxy)
        yield proxy, tenant, inflight, state
    finally:
        for s in reversed(servers):
            await s.stop()
        await forwarder.aclose()


T = TypeVar("T")


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, SAFETY_S)


# ---------------------------------------------------------------------------------------------
# Host / Origin


async def test_allowed_public_host_reaches_loopback_ollama_without_403() -> None:
    async with stack("ollama", ollama_like, allowed_hosts=["llm.example.com"]) as (proxy, tenant, _, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            direct = await c.get(f"{tenant.upstream}/echo", headers={"Host": "llm.example.com"})
            through = await c.get(f"{proxy.url}/echo", headers={"Host": "llm.example.com"})
    assert direct.status_code == 403 and direct.content == b"", "the test upstream should mimic Ollama's Host rule"
    assert through.status_code == 200, through.text
    headers = dict(through.json()["headers"])
    assert headers["host"] == urlsplit(tenant.upstream).netloc
    assert headers["x-forwarded-host"] == "llm.example.com"
    assert headers["x-forwarded-for"] == "127.0.0.1" and headers["x-forwarded-proto"] == "http"


async def test_forwarded_for_appends_the_socket_address_to_a_client_supplied_chain() -> None:
    # A loopback client's own X-Forwarded-For must not become the address the proxy reports.
    async with stack("ollama", ollama_like) as (proxy, _, _, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            through = await c.get(f"{proxy.url}/echo", headers={"X-Forwarded-For": "10.9.8.7"})
    headers = dict(through.json()["headers"])
    assert headers["x-forwarded-for"] == "10.9.8.7, 127.0.0.1"


async def test_browser_opened_on_proxy_passes_comfyui_origin_check() -> None:
    async with stack("comfyui", comfyui_like) as (proxy, _tenant, _, _):
        proxy_host = f"127.0.0.1:{proxy.port}"
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            same = await c.get(f"{proxy.url}/", headers={"Origin": f"http://{proxy_host}"})
            cross = await c.get(f"{proxy.url}/", headers={"Origin": "http://evil.example"})
            other_port = await c.get(f"{proxy.url}/", headers={"Origin": "http://127.0.0.1:3000"})
            none = await c.get(f"{proxy.url}/")
    assert same.status_code == 200, "a same-origin browser request must pass ComfyUI's Host/Origin check"
    assert (cross.status_code, cross.content) == (403, b""), "a cross-origin request must keep failing"
    assert other_port.status_code == 403
    assert none.status_code == 200


async def test_websocket_origin_rule_matches_http() -> None:
    async with stack("comfyui", comfyui_like) as (proxy, _, _, _):
        ws_url = f"ws://127.0.0.1:{proxy.port}/ws?clientId=abc"
        async with connect(ws_url, origin=Origin(f"http://127.0.0.1:{proxy.port}")) as ws:
            first = json.loads(await within(ws.recv()))
            assert first["data"]["sid"] == "abc", "clientId query must reach the upstream"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(ws_url, origin=Origin("http://evil.example")):
                pass
    assert refused.value.response.status_code == 403


# ---------------------------------------------------------------------------------------------
# Streaming, bodies, headers


async def test_each_ndjson_line_reaches_client_before_the_next_is_produced() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, inflight, state):
        got: list[dict[str, object]] = []
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            async with c.stream("POST", f"{proxy.url}/api/generate", json={"model": "m", "prompt": "hi"}) as r:
                assert r.headers["content-type"] == "application/x-ndjson"
                assert inflight.traffic("ollama").in_flight == 1, "a generate stream counts as in flight"
                lines = r.aiter_lines()
                for i in range(4):
                    got.append(json.loads(await within(lines.__anext__())))
                    if i < 3:
                        state.lines_seen[i].set()
        assert await inflight.wait_idle("ollama", SAFETY_S), "in-flight count must drop when the stream ends"
    assert [g["response"] for g in got] == ["w0", "w1", "w2", "w3"] and got[-1]["done"] is True


async def test_activity_counts_from_the_last_relayed_chunk_not_from_the_request_start() -> None:
    # A long generation: last_activity_age_s in /api/tenants must stay near 0 while chunks flow.
    clock = ManualClock()
    async with stack("ollama", ollama_like, clock=clock) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            async with c.stream("POST", f"{proxy.url}/api/generate", json={"model": "m", "prompt": "hi"}) as r:
                started = clock.now()
                lines = r.aiter_lines()
                for i in range(3):
                    await within(lines.__anext__())
                    if i < 2:
                        await clock.advance(5.0)
                        state.lines_seen[i].set()
                activity = inflight.traffic("ollama").last_activity
                state.lines_seen[2].set()
                async for _ in lines:
                    pass
    assert activity == started + 10.0, (f"the third line passed 10 s after the start, but activity is "
                                        f"{None if activity is None else activity - started:+.1f} s from it")


async def test_sse_events_are_flushed_one_by_one() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, state):
        events: list[str] = []
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            async with c.stream("POST", f"{proxy.url}/v1/chat/completions", json={}) as r:
                lines = r.aiter_lines()
                while len(events) < 4:
                    line = await within(lines.__anext__())
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) <= 3:
                            state.lines_seen[len(events) - 1].set()
    assert events[-1] == "[DONE]" and [json.loads(e)["i"] for e in events[:3]] == [0, 1, 2]


async def test_range_request_gets_206_with_the_slice() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            r = await c.get(f"{proxy.url}/range", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == bytes(range(10, 20))
    assert r.headers["content-range"] == "bytes 10-19/1024"


async def test_delete_body_and_query_string_are_forwarded() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            r = await c.request("DELETE", f"{proxy.url}/echo?a=1&b=%2F", content=b'{"model":"m"}')
    data = r.json()
    assert (data["method"], data["body"], data["query"]) == ("DELETE", '{"model":"m"}', "a=1&b=%2F")


async def test_compressed_bytes_pass_untouched_and_nothing_is_added() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            async with c.stream("GET", f"{proxy.url}/gz", headers={"Accept-Encoding": "gzip"}) as r:
                raw = b"".join([chunk async for chunk in r.aiter_raw()])
            await c.get(f"{proxy.url}/echo", headers={"Connection": "keep-alive, X-Hop", "X-Hop": "1",
                                                      "Accept-Encoding": "identity"})
    assert r.headers["content-encoding"] == "gzip" and gzip.decompress(raw) == b'{"ok": true}'
    sent = {k.lower(): v for k, v in state.last_headers.items()}
    assert "x-hop" not in sent, "headers named in Connection are hop-by-hop"
    assert sent["accept-encoding"] == "identity", "the proxy must not add or change Accept-Encoding"


async def _chunks(n_mib: int, gate: asyncio.Event, head_mib: int = 1) -> AsyncIterator[bytes]:
    block = b"x" * 2**20
    for _ in range(head_mib):
        yield block
    await within(gate.wait())  # the upstream must have bytes before the client sends the rest
    for _ in range(n_mib - head_mib):
        yield block


async def test_big_upload_streams_through_passthrough() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            r = await c.post(f"{proxy.url}/api/blobs/sha256-x", content=_chunks(64, state.upload_started))
    assert r.json() == {"received": 64 * 2**20}


async def test_gpu_body_over_replay_limit_streams_without_buffering() -> None:
    async with stack("generic", ollama_like, replay_body_max_mb=1.0) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            r = await c.post(f"{proxy.url}/upload", content=_chunks(8, state.upload_started, head_mib=2))
        assert await inflight.wait_idle("generic", SAFETY_S)
    assert r.json() == {"received": 8 * 2**20}


# ---------------------------------------------------------------------------------------------
# Failures and disconnects


async def test_closed_port_gives_502_naming_tenant_and_upstream() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    async with stack("ollama", None, upstream_url=f"http://127.0.0.1:{port}") as (proxy, tenant, inflight, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            r = await c.post(f"{proxy.url}/api/generate", json={"model": "m"})
        assert inflight.traffic("ollama").in_flight == 0
    body = r.json()
    assert r.status_code == 502 and body["tenant"] == "ollama" and body["upstream"] == tenant.upstream
    assert "refused" in body["error"], f"the error must say the connection was refused: {body['error']}"
    assert body["fix"].startswith("start ollama"), body["fix"]


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_an_engine_that_drops_the_request_after_accepting_it_gives_a_502_saying_so_not_start_it(
        how: str) -> None:
    async def drops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if how == "reset":  # linger 0: the close is a RST
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    server = await asyncio.start_server(drops, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with stack("ollama", None, upstream_url=f"http://127.0.0.1:{port}") as (proxy, _, _, _):
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                r = await c.post(f"{proxy.url}/api/generate", json={"model": "m"})
    finally:
        server.close()
    body = r.json()
    assert r.status_code == 502, r.content
    said = {"close": "closed the connection", "reset": "reset the connection"}[how]
    assert said in body["error"] and "accepted" in body["error"], f"the error must say what happened: {body['error']}"
    assert "start ollama" not in body["fix"] and "retry" in body["fix"], f"the engine is up; the fix: {body['fix']}"


FAILED = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 21\r\ncontent-type: text/plain; charset=utf-8\r\n"
          b"\r\nInternal Server Error")


async def _serve_failing_then_closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """llama.cpp's server behind llama-cpp-python (uvicorn, Starlette): a body that is not JSON makes
    the app raise; Starlette answers 500 without Connection: close and uvicorn closes the connection
    once it has logged the traceback, a few ms later (measured: the next request has been sent by
    then). Here: the 500, then the next request on that connection goes unanswered, the connection closed."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
            if body == b"not json":
                writer.write(FAILED)
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{\"ok\": true}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def test_a_post_after_an_engine_failure_goes_on_a_fresh_connection_not_into_the_one_it_closes() -> None:
    server = await asyncio.start_server(_serve_failing_then_closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with stack("generic", None, upstream_url=f"http://127.0.0.1:{port}") as (proxy, _, _, _):
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                failed = await c.post(f"{proxy.url}/v1/completions", content=b"not json")
                after = await c.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    finally:
        server.close()
    assert failed.status_code == 500 and failed.content == b"Internal Server Error"
    assert after.status_code == 200, f"the next POST must reach the engine, not a closed connection: {after.content!r}"


async def test_upstream_that_never_answers_gives_504() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(65536)
            await asyncio.sleep(SAFETY_S)  # hangs: an upstream that never answers (a fake, no threshold)
        finally:  # cancelled when the test's loop closes: the connection must not outlive it
            writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with stack("ollama", None, upstream_url=f"http://127.0.0.1:{port}",
                         timeouts=Timeouts(read_s=0.2)) as (proxy, _, _, _):
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                r = await c.get(f"{proxy.url}/api/tags")
    finally:
        server.close()
    assert r.status_code == 504 and r.json()["tenant"] == "ollama"


async def test_upstream_that_breaks_mid_stream_gives_the_client_a_broken_answer_not_a_short_one(
        caplog: pytest.LogCaptureFixture) -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"b\r\n{\"done\":0}\n\r\n")
        await writer.drain()
        writer.transport.abort()  # the engine crashed mid-generation

    server = await asyncio.start_server(breaks, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with stack("ollama", None, upstream_url=f"http://127.0.0.1:{port}") as (proxy, _, _inflight, _):
            server_errors = _Records()
            logging.getLogger("uvicorn.error").addHandler(server_errors)
            try:
                with caplog.at_level(logging.WARNING, logger="hyperswap"):
                    async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                        async with c.stream("GET", f"{proxy.url}/api/tags") as r:
                            received = b""
                            with pytest.raises(httpx.RemoteProtocolError):
                                async for chunk in r.aiter_raw():
                                    received += chunk
            finally:
                logging.getLogger("uvicorn.error").removeHandler(server_errors)
            assert received == b'{"done":0}\n', "what the engine sent before it broke still reaches the client"
    finally:
        server.close()
    assert [r.getMessage() for r in server_errors.records] == [], "the relay's own line says it; uvicorn adds none"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("hyperswap")]
    assert len(lines) == 1 and "broke mid-answer to GET /api/tags after 11 body bytes" in lines[0], lines


async def test_client_disconnect_closes_the_upstream_request() -> None:
    async with stack("generic", ollama_like) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            async with c.stream("POST", f"{proxy.url}/forever", content=b"{}") as r:
                assert (await within(r.aiter_raw().__anext__())) == b"tick\n"
                assert inflight.traffic("generic").in_flight == 1
        await within(state.disconnected.wait())  # the upstream saw its client (the proxy) go
        assert await inflight.wait_idle("generic", SAFETY_S), "a dropped client's request stops counting"


@pytest.mark.parametrize("method", ["GET", "POST"], ids=["passthrough", "gpu"])
async def test_client_leaving_before_the_answer_starts_closes_the_upstream_request(method: str) -> None:
    # A non-streamed generation sends nothing until it is done: the proxy must still notice the client go.
    async with stack("generic", ollama_like) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            waiting = asyncio.ensure_future(c.request(method, f"{proxy.url}/silent", content=b"{}" if method == "POST" else None))
            await within(state.request_arrived.wait())
            waiting.cancel()  # the client gives up and closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        await within(state.disconnected.wait())
        assert await inflight.wait_idle("generic", SAFETY_S)


async def _raw_request(url: str, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def test_body_still_uploading_after_the_answer_started_reaches_the_upstream_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # While the client still sends, the disconnect watch must not read (and lose) body chunks.
    monkeypatch.setattr("proxy.relay.departure.WATCH_AFTER_S", 0.0)
    async with stack("ollama", ollama_like) as (proxy, _, _, _):
        reader, writer = await _raw_request(proxy.url, b"POST /early HTTP/1.1\r\nHost: localhost\r\n"
                                                       b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"))
            assert head.startswith(b"HTTP/1.1 200")
            await within(reader.readuntil(b"started\n"))
            for i in range(1, 11):  # one part at a time: a part taken by anyone else is never acked
                writer.write(b"4\r\npart\r\n")
                await writer.drain()
                await within(reader.readuntil(b"got %d\n" % (4 * i)))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await within(reader.readuntil(b"end\n"))
        finally:
            writer.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("path", ["/api/blobs/sha256-x", "/api/generate"], ids=["passthrough", "gpu"])
async def test_upload_abandoned_half_way_ends_quietly_and_counts_nothing(path: str) -> None:
    server_errors = _Records()
    async with stack("ollama", ollama_like) as (proxy, _, inflight, state):
        # After the servers started: uvicorn's logging set-up drops handlers, and its logger does
        # not propagate to pytest's capture.
        logging.getLogger("uvicorn.error").addHandler(server_errors)
        _reader, writer = await _raw_request(proxy.url, f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
                                                        f"Content-Length: {2**20}\r\n\r\n".encode() + b"x" * 65536)
        if path.startswith("/api/blobs"):
            await within(state.upload_started.wait())  # the upstream is reading the streamed body
        writer.transport.abort()
        assert await inflight.wait_idle("ollama", SAFETY_S)
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:  # the listener still serves
            assert (await c.get(f"{proxy.url}/echo")).status_code == 200
        logging.getLogger("uvicorn.error").removeHandler(server_errors)
    assert [r.getMessage() for r in server_errors.records] == [], "a client leaving is not a server error"


# ---------------------------------------------------------------------------------------------
# WebSockets and ComfyUI jobs


async def test_websocket_frames_and_close_codes_pass_both_ways() -> None:
    async with stack("comfyui", comfyui_like) as (proxy, _, _, state):
        url = f"ws://127.0.0.1:{proxy.port}/ws?clientId=c1"
        async with connect(url) as ws:
            await within(ws.recv())  # status
            await ws.send("hello")
            assert await within(ws.recv()) == "echo:hello"
            await ws.send(b"\x00\x01\x02")
            assert await within(ws.recv()) == b"\x02\x01\x00"
            await ws.send("close:4001")
            with pytest.raises(websockets.ConnectionClosed):
                await within(ws.recv())
            assert ws.close_code == 4001 and ws.close_reason == "asked", "upstream close code must reach the client"
        async with connect(url) as ws:
            await within(ws.recv())
            await ws.close(4002)
        assert await within(state.ws_closed_with) == 4002, "client close code must reach the upstream"


async def test_websocket_idle_for_hours_stays_open(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two hours pass on the loop's clock in 15 s steps, so every timer due in that time fires: an
    # idle or read timeout on either leg ends the socket here (a bridge timing out after an hour does).
    # Pings are not caught: the peers here answer them at once, as browsers and aiohttp do.
    loop = asyncio.get_running_loop()
    skew = [0.0]
    real_time = loop.time
    monkeypatch.setattr(loop, "time", lambda: real_time() + skew[0])
    async with stack("comfyui", comfyui_like) as (proxy, _, _, state):
        async with connect(f"ws://127.0.0.1:{proxy.port}/ws?clientId=c1", ping_interval=None) as ws:
            await within(ws.recv())  # status
            for _ in range(2 * 3600 // 15):
                skew[0] += 15
                await until_all_wait()  # let whatever fired run (a ping, a close)
            state.to_socket.put_nowait("two hours later")
            assert await within(ws.recv()) == "two hours later"
            await ws.send("hello")
            assert await within(ws.recv()) == "echo:hello"


async def test_comfyui_prompt_stays_in_flight_until_ws_end_marker() -> None:
    async with stack("comfyui", comfyui_like) as (proxy, _, inflight, state):
        async with connect(f"ws://127.0.0.1:{proxy.port}/ws?clientId=c1") as ws:
            await within(ws.recv())
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                r = await c.post(f"{proxy.url}/prompt", json={"prompt": {}, "client_id": "c1", "prompt_id": "P1"})
            assert r.json()["prompt_id"] == "P1"
            await within(_until(lambda: inflight.traffic("comfyui").in_flight == 0))
            assert inflight.traffic("comfyui").jobs == ("P1",), "a queued prompt keeps the tenant busy"
            await state.to_socket.put(json.dumps({"type": "executing", "data": {"node": "3", "prompt_id": "P1"}}))
            await within(ws.recv())
            assert inflight.busy("comfyui")
            await state.to_socket.put(json.dumps({"type": "executing", "data": {"node": None, "prompt_id": "P1"}}))
            await within(ws.recv())
            assert not inflight.busy("comfyui"), "the end marker over the socket ends the job"


async def test_comfyui_prompt_without_socket_ends_via_history_poll() -> None:
    clock = ManualClock()
    async with stack("comfyui", comfyui_like, clock=clock) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            r = await c.post(f"{proxy.url}/api/prompt", json={"prompt": {}})
        pid = r.json()["prompt_id"]
        await within(_until(lambda: inflight.traffic("comfyui").jobs == (pid,)))
        await clock.advance(60.0)  # the poller's turn comes while /history is still empty
        assert not await inflight.wait_idle("comfyui", 0.05), "history still empty: the job is running"
        state.history_done.add(pid)
        await clock.advance(60.0)  # its next turn
        assert await inflight.wait_idle("comfyui", SAFETY_S), "the poller must see /history list the prompt"


async def test_a_client_polling_history_through_the_proxy_ends_the_job_when_it_sees_the_end() -> None:
    # the manual clock never moves: the proxy's own poll never runs, so only the client's poll of
    # /history passing through can end the job (before, a swap away waited up to job_poll_s for it)
    clock = ManualClock()
    async with stack("comfyui", comfyui_like, clock=clock) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            pid = (await c.post(f"{proxy.url}/prompt", json={"prompt": {}})).json()["prompt_id"]
            await within(_until(lambda: inflight.traffic("comfyui").jobs == (pid,)))
            assert not await inflight.wait_idle("comfyui", 0.05), "the job ended before its end"
            state.history_done.add(pid)
            seen = (await c.get(f"{proxy.url}/history/{pid}")).json()
        assert seen[pid]["status"]["completed"] is True
        assert await inflight.wait_idle("comfyui", SAFETY_S), "the client saw the end; the proxy did not"


async def _until(pred: Callable[[], bool]) -> None:
    await poll_until(pred, 0)


# ---------------------------------------------------------------------------------------------
# The official client


async def test_official_ollama_client_streams_generate_through_proxy() -> None:
    async with stack("ollama", ollama_like) as (proxy, _, _, state):
        words: list[str] = []
        async with ollama.AsyncClient(host=proxy.url, verify=LOOPBACK_TLS) as client:
            async for part in await client.generate(model="m", prompt="hi", stream=True):
                words.append(part.response)
                if len(words) <= 3:
                    state.lines_seen[len(words) - 1].set()
        assert part.done and part.done_reason == "stop"
    assert words == ["w0", "w1", "w2", "w3"]


# ---------------------------------------------------------------------------------------------
# Answers with no body, answers the proxy cannot relay, the per-upstream connection cap


@contextlib.asynccontextmanager
async def raw_upstream(answer_for: Callable[[bytes], bytes]) -> AsyncIterator[str]:
    """An engine that answers each request head (bodiless requests only) with the bytes given."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer_for(await reader.readuntil(b"\r\n\r\n")))

    async with _engine(answer) as url:
        yield url


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _engine(answer: Serve) -> AsyncIterator[str]:
    """A raw engine on a port of its own: `answer` serves one request of a kept-alive connection,
    again and again until the client closes it."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await answer(reader, writer)
            await writer.drain()

    async with _listening(serve) as url:
        yield url


@contextlib.asynccontextmanager
async def _listening(serve: Serve) -> AsyncIterator[str]:
    """`serve` run for each connection to a port of its own (its URL yielded), the connection closed
    when it returns or the client goes."""
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await within(reader.readuntil(b"\r\n\r\n"))
    status, *lines = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    bodiless = status.split()[1] in (b"204", b"304")
    body = b"" if bodiless else await within(reader.readexactly(int(headers.get(b"content-length", b"0"))))
    return status, headers, body


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_a_bodiless_answer_with_a_content_length_keeps_the_connection_and_what_is_pipelined_behind(
        status: bytes) -> None:
    # RFC 9110 8.6 lets a 304 carry the representation's Content-Length; some engines send one on a 204 too.
    def answer_for(head: bytes) -> bytes:
        if head.startswith(b"GET /first "):
            return b"HTTP/1.1 " + status + b"\r\nContent-Length: 5\r\nETag: \"e1\"\r\n\r\n"
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    server_errors = _Records()
    async with raw_upstream(answer_for) as url:
        async with stack("generic", None, upstream_url=url) as (proxy, _, _, _):
            logging.getLogger("uvicorn.error").addHandler(server_errors)
            reader, writer = await _raw_request(proxy.url, b"GET /first HTTP/1.1\r\nHost: localhost\r\n\r\n"
                                                           b"GET /second HTTP/1.1\r\nHost: localhost\r\n\r\n")
            try:
                first, second = await _read_answer(reader), await _read_answer(reader)
                writer.write(b"GET /third HTTP/1.1\r\nHost: localhost\r\n\r\n")
                third = await _read_answer(reader)
            finally:
                writer.close()
                logging.getLogger("uvicorn.error").removeHandler(server_errors)
    assert first[0] == b"HTTP/1.1 " + status and first[1][b"etag"] == b'"e1"' and first[2] == b""
    assert (second[0], second[2]) == (b"HTTP/1.1 200 OK", b"ok"), "the pipelined request must be answered"
    assert (third[0], third[2]) == (b"HTTP/1.1 200 OK", b"ok"), "the connection must stay open"
    assert [r.getMessage() for r in server_errors.records] == []


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
], ids=["101-on-a-plain-get", "gzip-transfer-coding"])
async def test_an_answer_the_proxy_cannot_relay_gives_502_naming_tenant_and_upstream(answer: bytes) -> None:
    async with raw_upstream(lambda head: answer) as url:
        async with stack("ollama", None, upstream_url=url) as (proxy, tenant, _, _):
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                r = await c.get(f"{proxy.url}/api/tags")
                assert (await c.get(f"{proxy.url}/api/tags")).status_code == 502, "and again on the next request"
    body = r.json()
    assert r.status_code == 502, r.content
    assert body["tenant"] == "ollama" and body["upstream"] == tenant.upstream and body["fix"]
    assert "cannot relay" in body["error"]


async def test_requests_past_the_per_upstream_cap_wait_then_get_503() -> None:
    async with stack("generic", ollama_like, max_connections=1, timeouts=Timeouts(pool_s=0.1)) as (proxy, _, _, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            holding = asyncio.ensure_future(c.get(f"{proxy.url}/silent"))  # holds the only connection
            await within(state.request_arrived.wait())
            refused = await c.get(f"{proxy.url}/echo")
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
            await within(state.disconnected.wait())
            after = await c.get(f"{proxy.url}/echo")
    body = refused.json()
    assert refused.status_code == 503 and body["tenant"] == "generic" and "pool_s" in body["fix"], body
    assert after.status_code == 200, "the connection freed by the client that left must serve the next request"


async def test_a_websocket_refused_by_an_http10_app_gets_the_apps_status_not_a_502() -> None:
    """Issue 42: an app that speaks HTTP/1.0 (Python's http.server) answers an upgrade with its own
    status line, which the websockets client cannot parse: the client got 502 as if the app were
    down. It gets the app's own refusal now."""
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 404 File not found\r\nContent-Type: text/html\r\n\r\nnot here")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http10, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with stack("generic", None, upstream_url=f"http://127.0.0.1:{port}") as (proxy, _, _, _):
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with connect(proxy.url.replace("https://", "wss://").replace("http://", "ws://") + "/ws",
                                   ssl=LOOPBACK_TLS if proxy.url.startswith("https") else None, open_timeout=5):
                    pass
    finally:
        server.close()
        await server.wait_closed()
    answer = refused.value.response
    assert answer.status_code == 404, f"{answer.status_code}: the app's own refusal, not a 502"
    assert b"HTTP/1.0 404" in answer.body, answer.body


# ---------------------------------------------------------------------------------------------
# A passthrough GET run by the listener's protocol itself (proxy/relay/inline.py)


class _InlineSpy:
    """Counts the exchanges the listener ran inline (each one a request served with no task)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from proxy.relay import inline, listener
        self.count = 0
        spy = self

        class Counted(inline.InlineExchange):
            __slots__ = ()

            def __init__(self, *args: object, **kwargs: object) -> None:
                spy.count += 1
                super().__init__(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(listener, "InlineExchange", Counted)


async def _raw_answer(reader: asyncio.StreamReader) -> bytes:
    """One answer's bytes exactly as the client got them (Content-Length or chunked framing)."""
    head = await within(reader.readuntil(b"\r\n\r\n"))
    assert isinstance(head, bytes)
    if b"transfer-encoding: chunked" in head.lower():
        return head + await within(reader.readuntil(b"0\r\n\r\n"))
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head + await within(reader.readexactly(length))


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nKeep-Alive: timeout=5\r\nConnection: keep-alive\r\n"
    b"X-Engine: 1\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
], ids=["content-length", "chunked", "empty"])
async def test_a_passthrough_get_answered_inline_is_byte_for_byte_the_answer_the_asgi_path_gives(
        monkeypatch: pytest.MonkeyPatch, answer: bytes) -> None:
    async def three_answers() -> list[bytes]:
        async with raw_upstream(lambda head: answer) as url:
            async with stack("generic", None, upstream_url=url) as (proxy, _, inflight, _):
                get = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"
                reader, writer = await _raw_request(proxy.url, get)
                try:
                    out = [await _raw_answer(reader)]  # no idle connection to the upstream yet: the ASGI path
                    writer.write(get)
                    out.append(await _raw_answer(reader))  # the pooled connection: inline
                    writer.write(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                    out.append(await _raw_answer(reader))
                    assert await within(reader.read()) == b"", "an answer to Connection: close ends the connection"
                finally:
                    writer.close()
                assert await inflight.wait_idle("generic", SAFETY_S) and inflight.connections("generic") == 0
        return out

    spy = _InlineSpy(monkeypatch)
    inline = await three_answers()
    assert spy.count == 2
    monkeypatch.setattr(TenantApp, "start_inline", lambda self, server, target, headers, version: None)
    by_task = await three_answers()
    assert spy.count == 2
    assert inline == by_task, (by_task, inline)
    assert b"connection: close" in inline[2] and b"connection: close" not in inline[1]


async def test_inline_gets_remembered_per_head_still_send_each_head_its_own_upstream_head_and_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The listener remembers the upstream head per request head, and the client head per upstream
    # answer head: a poll that changes only its Host, a header or its answer must get its own.
    seen: list[bytes] = []
    served = [0]

    def answer(head: bytes) -> bytes:
        seen.append(head)
        served[0] += 1
        return b"HTTP/1.1 200 OK\r\nX-Served: %d\r\nContent-Length: 2\r\n\r\nok" % served[0]

    spy = _InlineSpy(monkeypatch)
    async with raw_upstream(answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        heads = [b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"] * 3 + [
            b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nX-Client: a\r\n\r\n",
            b"GET /api/tags?all=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
            b"GET /api/tags HTTP/1.1\r\nHost: evil.example\r\n\r\n",
            b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n",
        ]
        reader, writer = await _raw_request(proxy.url, heads[0])
        answers = []
        try:
            answers.append(await _read_answer(reader))
            for head in heads[1:]:
                writer.write(head)
                answers.append(await _read_answer(reader))
        finally:
            writer.close()
    statuses = [a[0].split()[1] for a in answers]
    assert statuses == [b"200"] * 6 + [b"403", b"200"], statuses
    assert [a[1][b"x-served"] for a in answers if a[0].split()[1] == b"200"] == [b"%d" % n for n in range(1, 8)], \
        "each answer is the upstream's own, never a remembered one"
    assert len(seen) == 7, "the refused Host never reaches the engine"
    forwarded = [dict(line.split(b": ", 1) for line in h.split(b"\r\n")[1:] if b": " in line) for h in seen]
    assert [f[b"x-forwarded-host"] for f in forwarded] == [b"localhost"] * 3 + [b"127.0.0.1", b"localhost",
                                                                                 b"localhost", b"localhost"]
    assert b"x-client" in forwarded[4] and all(b"x-client" not in f for i, f in enumerate(forwarded) if i != 4)
    assert seen[5].startswith(b"GET /api/tags?all=1 HTTP/1.1") and seen[6].startswith(b"GET /api/tags HTTP/1.1")
    assert spy.count >= 6, "all but the first (no idle connection yet) ran inline"


class _ParseSpy:
    """Counts the upstream answers parsed (each one a `Response` made by an inline exchange)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from proxy.relay import http1
        self.count = 0
        spy = self
        made = http1.Response

        def counted(*args: Any, **kwargs: Any) -> http1.Response:
            spy.count += 1
            return made(*args, **kwargs)

        monkeypatch.setattr(http1, "Response", counted)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Engine: 1\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
], ids=["body", "empty"])
async def test_an_answer_whose_head_was_parsed_before_goes_back_unparsed_and_byte_for_byte_the_same(
        monkeypatch: pytest.MonkeyPatch, answer: bytes) -> None:
    # The lane knows an answer by its head's bytes once it parsed one whole in a single read: the
    # third and fourth GETs get the same bytes the parsed second one did, and no parse.
    spy = _ParseSpy(monkeypatch)
    async with raw_upstream(lambda head: answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        get = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"
        reader, writer = await _raw_request(proxy.url, get)
        try:
            got = [await _raw_answer(reader)]  # the ASGI path: no idle upstream connection yet
            for _ in range(3):
                writer.write(get)
                got.append(await _raw_answer(reader))
        finally:
            writer.close()
    assert got[1] == got[2] == got[3] == got[0], got
    assert spy.count == 2, "the ASGI path's answer and the first inline one are parsed; later ones are known by sight"


async def test_an_answer_with_a_known_head_but_another_body_length_is_parsed_and_its_connection_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Same head bytes, one byte more than its Content-Length: a malformed answer is never taken for the
    # known one; the parse finds the stray byte and the connection is dropped, as it always was.
    answers = iter([b"ok", b"ok", b"okX", b"ok"])

    def answer(head: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + next(answers)

    spy = _ParseSpy(monkeypatch)
    async with raw_upstream(answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        get = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"
        reader, writer = await _raw_request(proxy.url, get)
        try:
            got = [await _raw_answer(reader)]
            for _ in range(3):
                writer.write(get)
                got.append(await _raw_answer(reader))
        finally:
            writer.close()
    assert [g.rsplit(b"\r\n\r\n", 1)[1] for g in got] == [b"ok"] * 4, "the client gets the Content-Length it was told"
    # parsed: the ASGI path's, the first inline one, the malformed one, and the fourth, which found no
    # idle connection (the malformed answer's was dropped) and took the ASGI path on a new one
    assert spy.count == 4, spy.count


class _ReadSpy:
    """Counts the GETs a listener served from a read it knew byte for byte (no parse)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        spy = self
        start = TenantApp.start_read

        def counted(app: TenantApp, server: Any, data: bytes) -> Any:
            exchange = start(app, server, data)
            spy.count += exchange is not None
            return exchange

        monkeypatch.setattr(TenantApp, "start_read", counted)


async def _raw_request_from(url: str, head: bytes, local: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, local_addr=(local, 0))
    writer.write(head)
    await writer.drain()
    return reader, writer


def _fields(head: bytes) -> dict[bytes, bytes]:
    return dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)


async def test_a_get_read_again_byte_for_byte_is_served_unparsed_for_the_same_client_and_parsed_for_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bytes] = []

    def answer(head: bytes) -> bytes:
        seen.append(head)
        return b"HTTP/1.1 200 OK\r\nX-Served: %d\r\nContent-Length: 2\r\n\r\nok" % len(seen)

    spy = _ReadSpy(monkeypatch)
    get = b"GET /api/tags?x=1 HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
    async with raw_upstream(answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, inflight, _):
        reader, writer = await _raw_request(proxy.url, get)
        try:
            got = [await _read_answer(reader)]  # the ASGI path (no idle upstream connection yet)
            for _ in range(3):
                writer.write(get)
                got.append(await _read_answer(reader))
        finally:
            writer.close()
        assert spy.count == 2, "the third and fourth GETs were the second's bytes again: served unparsed"
        reader, writer = await _raw_request_from(proxy.url, get, "127.0.0.2")
        try:
            got.append(await _read_answer(reader))  # same bytes, another client: parsed, its own upstream head
        finally:
            writer.close()
        assert spy.count == 2
        assert await inflight.wait_idle("generic", SAFETY_S) and inflight.connections("generic") == 0
    assert [g[1][b"x-served"] for g in got] == [b"1", b"2", b"3", b"4", b"5"], "every answer is the upstream's own"
    assert [g[2] for g in got] == [b"ok"] * 5
    assert seen[1] == seen[2] == seen[3], "the known read sends upstream what the parsed one sent"
    assert [_fields(h)[b"x-forwarded-for"] for h in seen] == [b"127.0.0.1"] * 4 + [b"127.0.0.2"]
    assert seen[4].startswith(b"GET /api/tags?x=1 HTTP/1.1\r\n")


@pytest.mark.parametrize("first", [
    b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    b"GET /api/tags HTTP/1.0\r\nHost: localhost\r\n\r\n",
    b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n\r\n",
], ids=["connection-close", "http-1.0", "expect"])
async def test_a_get_that_ends_its_connection_or_expects_is_never_served_unparsed(
        monkeypatch: pytest.MonkeyPatch, first: bytes) -> None:
    spy = _ReadSpy(monkeypatch)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_upstream(lambda head: answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        warm = b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n\r\n"
        reader, writer = await _raw_request(proxy.url, warm)  # leaves an idle upstream connection
        try:
            await _read_answer(reader)
            for _ in range(2):  # the same bytes twice, on a connection of their own each time
                r2, w2 = await _raw_request(proxy.url, first)
                try:
                    status, _headers, body = await _read_answer(r2)
                    assert (status.split()[1], body) == (b"200", b"ok")
                    if b"100-continue" not in first:
                        assert await within(r2.read()) == b"", "the connection ends after the answer"
                finally:
                    w2.close()
        finally:
            writer.close()
    assert spy.count == 0


async def test_two_gets_in_one_read_are_answered_in_order_and_not_learnt_as_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _ReadSpy(monkeypatch)
    served = [0]

    def answer(head: bytes) -> bytes:
        served[0] += 1
        return b"HTTP/1.1 200 OK\r\nX-Served: %d\r\nContent-Length: 2\r\n\r\nok" % served[0]

    one = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"
    async with raw_upstream(answer) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        reader, writer = await _raw_request(proxy.url, one)
        try:
            got = [await _read_answer(reader)]
            for _ in range(2):
                writer.write(one + one)  # pipelined: one read, two requests
                got += [await _read_answer(reader), await _read_answer(reader)]
        finally:
            writer.close()
    assert [g[1][b"x-served"] for g in got] == [b"%d" % n for n in range(1, 6)]
    assert spy.count == 0, "a read of two requests is never taken for one"


@contextlib.asynccontextmanager
async def echo_upstream() -> AsyncIterator[str]:
    """An engine that answers every request with what it was (X-Echo: method and target; the body:
    that and the request body's length), keep-alive; `split` in the target: the head, then the body
    a few loop turns later; `big`: a 20 KiB body (past what an inline answer writes whole)."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].split(b" ")
        fields = {k.lower(): v for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n")[1:])}
        sent = await reader.readexactly(int(fields.get(b"content-length", b"0")))
        body = b"%s %s %d" % (method, target, len(sent)) + (b"." * 20_000 if b"big" in target else b"")
        answer_head = b"HTTP/1.1 200 OK\r\nX-Echo: %s %s\r\nContent-Length: %d\r\n\r\n" % (
            method, target, len(body))
        if b"split" in target:
            writer.write(answer_head)
            await writer.drain()
            for _ in range(3):  # loop turns for the relay to read the head on its own
                await asyncio.sleep(0)
            writer.write(body)
        else:
            writer.write(answer_head + body)

    async with _engine(answer) as url:
        yield url


def _random_request(rng: random.Random) -> tuple[bytes, bytes, bool]:
    """A request's bytes, the X-Echo its answer must carry, and whether it ends its connection."""
    kind = rng.choice(["known", "known", "other", "split", "big", "query", "post", "close"])
    host = b"Host: localhost\r\n"
    if kind == "post":
        body = b"x" * rng.randint(0, 40)
        return b"POST /api/echo HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (host, len(body), body), \
            b"POST /api/echo", False
    target = {"known": b"/api/tags", "other": b"/api/version", "split": b"/api/split", "big": b"/api/big",
              "query": b"/api/tags?r=%d" % rng.randint(0, 3), "close": b"/api/tags"}[kind]
    close = b"Connection: close\r\n" if kind == "close" else b""
    return b"GET %s HTTP/1.1\r\n%s%s\r\n" % (target, host, close), b"GET " + target, kind == "close"


@pytest.mark.parametrize("seed", range(6))
async def test_random_mixes_of_gets_posts_and_pipelined_pairs_get_each_its_own_answer_in_order(seed: int) -> None:
    # The inline lane (parsed, known by its bytes, answers known by sight, whole or split or big, handed
    # to a task) beside the ASGI path, one connection at a time, some reads holding two requests.
    rng = random.Random(seed)
    async with echo_upstream() as url, stack("generic", None, upstream_url=url) as (proxy, _, inflight, _):
        reader, writer = await _raw_request(proxy.url, b"")
        try:
            for _ in range(30):
                batch = [_random_request(rng) for _ in range(rng.choice([1, 1, 1, 2]))]
                if any(close for _, _, close in batch[:-1]):
                    batch = batch[:1]  # nothing is answered after a Connection: close
                writer.write(b"".join(raw for raw, _, _ in batch))
                for raw, echo, _ in batch:
                    status, headers, body = await _read_answer(reader)
                    assert (status.split()[1], headers.get(b"x-echo")) == (b"200", echo), (seed, raw)
                    sent = raw.partition(b"\r\n\r\n")[2]
                    assert body.startswith(echo + b" %d" % len(sent)), (seed, raw, body[:80])
                if batch[-1][2]:
                    assert await within(reader.read()) == b"", "the connection ends after a Connection: close"
                    writer.close()
                    reader, writer = await _raw_request(proxy.url, b"")
        finally:
            writer.close()
        assert await inflight.wait_idle("generic", SAFETY_S)
        await poll_until(lambda: inflight.connections("generic") == 0, 0.01)


async def test_a_client_leaving_an_inline_get_before_its_answer_drops_the_upstream_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _InlineSpy(monkeypatch)
    async with stack("generic", ollama_like) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            assert (await c.get(f"{proxy.url}/echo")).status_code == 200  # leaves an idle upstream connection
            waiting = asyncio.ensure_future(c.get(f"{proxy.url}/silent"))
            await within(state.request_arrived.wait())
            assert spy.count == 1, "the second GET is run inline"
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        await within(state.disconnected.wait())
        assert await inflight.wait_idle("generic", SAFETY_S)
        await within(poll_until(lambda: inflight.connections("generic") == 0, 0.01))


async def test_an_inline_get_whose_answer_streams_is_relayed_as_it_comes_and_ends_with_its_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _InlineSpy(monkeypatch)
    async with stack("generic", ollama_like) as (proxy, _, inflight, state):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=None) as c:
            assert (await c.get(f"{proxy.url}/echo")).status_code == 200
            async with c.stream("GET", f"{proxy.url}/forever") as r:
                assert (await within(r.aiter_raw().__anext__())) == b"tick\n"
                assert spy.count == 1
        await within(state.disconnected.wait())
        await within(poll_until(lambda: inflight.connections("generic") == 0, 0.01))


async def test_an_inline_get_on_a_connection_the_engine_closed_unanswered_is_served_again_on_a_fresh_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _InlineSpy(monkeypatch)
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # answers the first request of each connection keep-alive; a second one is closed unanswered
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        heads.append(await reader.readuntil(b"\r\n\r\n"))

    async with _listening(serve) as url, stack("generic", None, upstream_url=url) as (proxy, _, _, _):
        async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
            first = await c.get(f"{proxy.url}/api/tags")
            second = await c.get(f"{proxy.url}/api/tags")
    assert (first.status_code, first.content, second.status_code, second.content) == (200, b"ok", 200, b"ok")
    assert spy.count == 1 and len(heads) == 3, heads


async def test_an_inline_get_whose_answer_cannot_be_relayed_gives_the_same_502(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _InlineSpy(monkeypatch)
    answers = iter([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"])
    async with raw_upstream(lambda head: next(answers)) as url:
        async with stack("generic", None, upstream_url=url) as (proxy, _, inflight, _):
            async with httpx.AsyncClient(verify=LOOPBACK_TLS) as c:
                assert (await c.get(f"{proxy.url}/api/tags")).status_code == 200
                r = await c.get(f"{proxy.url}/api/tags")
            await within(poll_until(lambda: inflight.connections("generic") == 0, 0.01))
    assert spy.count == 1
    assert r.status_code == 502 and r.json()["tenant"] == "generic" and "cannot relay" in r.json()["error"], r.content
