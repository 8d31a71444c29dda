"""The client side of every listener (proxy/inbound.py, proxy/servers.py): request-head limits, the
header timeout, the connection cap, and failed accepts logged once per interval. Raw sockets on
loopback; nothing here measures time, the waits only turn a hang into a failure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import pytest
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect

from proxy.config.schema import Tenant
from proxy.handoff.inflight import InFlight
from proxy.relay.forward import Forwarder
from proxy.relay.inbound import InboundLimits
from proxy.relay.listener import TenantApp
from proxy.relay.servers import ACCEPT_FAILED, RunningServer, start_server
from proxy.tasks import poll_until

SAFETY_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


class Upstream:
    """An engine stand-in that records the requests it got: `/stream` sends a line, then the
    rest once `more` is set; `/ws` echoes; anything else answers 200 with the request's size."""

    def __init__(self) -> None:
        self.heads: list[int] = []  # bytes of headers per request seen
        self.more = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            while (message := await receive())["type"] == "websocket.receive":
                await send({"type": "websocket.send", "text": "echo:" + (message.get("text") or "")})
            return
        self.heads.append(sum(len(k) + len(v) for k, v in scope["headers"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
            await self.more.wait()
            await send({"type": "http.response.body", "body": b"last\n"})
            return
        answer = json.dumps({"body": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


@contextlib.asynccontextmanager
async def served(limits: InboundLimits | None = None, *,
                 through_proxy: bool = False) -> AsyncIterator[tuple[RunningServer, Upstream]]:
    """The upstream app on a listener with these limits, or behind a tenant listener that has them."""
    upstream = Upstream()
    servers: list[RunningServer] = []
    forwarder = Forwarder()
    try:
        if through_proxy:
            # The proxy adds X-Forwarded-For/-Proto/-Host: the engine stand-in takes a few more headers.
            engine = await start_server(upstream, name="engine", limits=InboundLimits(max_headers=200))
            servers.append(engine)
            tenant = Tenant(name="generic", engine="generic", upstream=engine.url)
            app = TenantApp(tenant, forwarder, InFlight())
            servers.append(await start_server(app, name="generic", limits=limits))
        else:
            servers.append(await start_server(upstream, name="plain", limits=limits))
        yield servers[-1], upstream
    finally:
        upstream.more.set()
        for server in reversed(servers):
            await server.stop()
        await forwarder.aclose()


T = TypeVar("T")


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, SAFETY_S)


async def open_to(server: RunningServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await within(reader.readuntil(b"\r\n\r\n"))
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await within(reader.readexactly(int(headers.get("content-length", "0"))))
    return int(lines[0].split()[1]), headers, body


async def exchange(server: RunningServer, data: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """Send these bytes on a new connection; the answer, and what follows it before EOF when it
    closes the connection."""
    reader, writer = await open_to(server)
    try:
        writer.write(data)
        status, headers, body = await read_answer(reader)
        rest = await within(reader.read()) if headers.get("connection") == "close" else b""
        return status, headers, body, rest
    finally:
        writer.close()


def request(target: str = "/", headers: list[tuple[str, str]] | None = None) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: localhost", *(f"{k}: {v}" for k, v in headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# ---------------------------------------------------------------------------------------------
# Request-head limits


@pytest.mark.parametrize("what, data, status", [
    ("a header line over 8 KiB", request(headers=[("X-Big", "a" * 8200)]), 431),
    ("more than 100 headers", request(headers=[(f"X-{i}", "1") for i in range(101)]), 431),
    ("a head over 64 KiB in lines under 8 KiB", request(headers=[(f"X-{i}", "a" * 7000) for i in range(10)]), 431),
    ("a request target over 8 KiB", request("/" + "a" * 8200), 414),
], ids=["line", "count", "total", "target"])
async def test_an_oversized_request_head_is_refused_and_never_forwarded(what: str, data: bytes, status: int) -> None:
    async with served(through_proxy=True) as (proxy, upstream):
        got, headers, body, rest = await exchange(proxy, data)
        assert got == status, f"{what}: answered {got}"
        answer = json.loads(body)
        assert answer["error"] and answer["fix"], answer
        assert headers["connection"] == "close" and rest == b"", "the connection must end after the refusal"
        assert upstream.heads == [], f"{what} must not reach the engine"
        assert (await exchange(proxy, request()))[0] == 200, "the listener keeps serving"


async def test_heads_at_the_limits_pass_whole() -> None:
    at_limits = [
        request(headers=[("X-Big", "a" * (8192 - len("x-big")))]),
        request(headers=[(f"X-{i}", "1") for i in range(99)]),  # and Host: 100
        request("/" + "a" * 8191),
    ]
    async with served(through_proxy=True) as (proxy, upstream):
        for data in at_limits:
            assert (await exchange(proxy, data))[0] == 200
    assert len(upstream.heads) == 3


async def test_a_huge_header_is_refused_before_it_has_all_arrived() -> None:
    # 64 MiB in 64 KiB writes: refused after about one read past the limit, while the client still sends.
    async with served() as (server, upstream):
        reader, writer = await open_to(server)
        answer = asyncio.ensure_future(read_answer(reader))
        writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        block = b"a" * 65536
        sent = 0
        with contextlib.suppress(ConnectionError):
            while not answer.done() and sent < 64 << 20:
                writer.write(block)
                await within(writer.drain())
                sent += len(block)
        status, _, body = await within(answer)
        writer.close()
    assert status == 431 and "over 65536 bytes" in json.loads(body)["error"]
    assert sent < 16 << 20, f"the client could send {sent >> 20} MiB of one header before the refusal"
    assert upstream.heads == []


async def test_a_request_pipelined_behind_a_big_body_is_not_taken_for_a_big_head() -> None:
    body = b"b" * 200_000
    first = b"POST /upload HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    second = request(headers=[("X-Pad", "p" * 4000)])
    async with served() as (server, _):
        reader, writer = await open_to(server)
        writer.write(first + second[:100])  # the second head starts in the same reads as the body's end
        await writer.drain()
        writer.write(second[100:])
        answers = [await read_answer(reader), await read_answer(reader)]
        writer.close()
    assert [status for status, _, _ in answers] == [200, 200]
    assert json.loads(answers[0][2]) == {"body": len(body)}


async def test_an_oversized_head_pipelined_behind_a_stream_never_lands_inside_its_answer() -> None:
    async with served() as (server, upstream):
        reader, writer = await open_to(server)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n" + request(headers=[("X-Big", "a" * 9000)]))
        head = await within(reader.readuntil(b"\r\n\r\n"))
        upstream.more.set()
        rest = await within(reader.read())  # the connection ends after the stream's answer
        writer.close()
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    assert rest.endswith(b"last\n\r\n0\r\n\r\n") and b"HTTP/1.1" not in rest, rest


# ---------------------------------------------------------------------------------------------
# Header timeout


async def test_a_head_that_stops_arriving_gets_408_and_the_connection_ends() -> None:
    async with served(InboundLimits(header_timeout_s=0.1)) as (server, upstream):
        reader, writer = await open_to(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow")  # and nothing more: slowloris
        status, _, body = await read_answer(reader)
        assert await within(reader.read()) == b""
        writer.close()
    assert status == 408 and json.loads(body)["fix"]
    assert upstream.heads == []


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer() -> None:
    async with served(InboundLimits(header_timeout_s=0.1)) as (server, _):
        reader, writer = await open_to(server)
        assert await within(reader.read()) == b""
        writer.close()


async def test_the_header_timeout_covers_the_next_head_on_a_kept_alive_connection() -> None:
    # the first head must beat the timeout even on a loaded machine: 0.4 s, not 0.1
    async with served(InboundLimits(header_timeout_s=0.4)) as (server, _):
        reader, writer = await open_to(server)
        writer.write(request())
        assert (await read_answer(reader))[0] == 200
        writer.write(b"GET / HTTP/1.1\r\nHo")
        assert (await read_answer(reader))[0] == 408
        writer.close()


async def test_a_kept_alive_connection_is_closed_once_idle_for_the_keep_alive_timeout() -> None:
    # one keep-alive timer per listener (Guard.rest): a connection that answered and then rests is
    # closed by it, one still in use is not, and a closed one leaves the listener's list
    async with served() as (server, _):
        # read by each new connection; uvicorn types it int, its keep-alive timer takes any seconds
        server.server.config.timeout_keep_alive = 0.2  # type: ignore[assignment]
        guard = server.server.config.http.__self__  # type: ignore[union-attr]
        idle_reader, idle_writer = await open_to(server)
        idle_writer.write(request())
        assert (await read_answer(idle_reader))[0] == 200
        busy_reader, busy_writer = await open_to(server)
        busy_writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")  # its answer stays open
        assert await within(busy_reader.readuntil(b"first\n"))
        assert await within(idle_reader.read()) == b"", "the idle connection must be closed"
        assert not busy_reader.at_eof(), "a connection in the middle of an answer is never closed as idle"
        await poll_until(lambda: not guard.resting, 0.01)
        left_reader, left_writer = await open_to(server)
        left_writer.write(request())
        assert (await read_answer(left_reader))[0] == 200
        assert len(guard.resting) == 1
        left_writer.close()
        await within(poll_until(lambda: not guard.resting, 0.01))
        for writer in (idle_writer, busy_writer):
            writer.close()


async def a_header_timeout_passes(server: RunningServer) -> None:
    """Return once a header timeout has passed for everything the listener read before this call.

    The timeout is the event loop's own timer (`loop.call_later` in the listener's protocol, a
    transport callback: no task to hand a Clock to). So rather than sleeping a fixed time, a second
    connection that sends half a head waits for its own 408: the loop runs timers in deadline
    order, so any header timer armed before it, of the same length, has fired by then."""
    reader, writer = await open_to(server)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHo")
        assert (await read_answer(reader))[0] == 408, "the reference connection must time out"
    finally:
        writer.close()


async def test_the_header_timeout_never_cuts_a_slow_upload_a_long_stream_or_a_websocket() -> None:
    # Each head (the websocket's handshake too) must still arrive within the timeout: 0.05 s cut a
    # handshake on a loaded 2-core CI run, so the timeout leaves room; each wait spans a whole one.
    limits = InboundLimits(header_timeout_s=0.4)
    async with served(limits, through_proxy=True) as (proxy, upstream):
        reader, writer = await open_to(proxy)
        try:
            writer.write(b"POST /upload HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10\r\n\r\nhello")
            # the listener has read the head and "hello" (one write, one read): its timer, if any, runs
            await within(poll_until(lambda: proxy.requests_running == 1))
            await a_header_timeout_passes(proxy)
            writer.write(b"world")
            assert json.loads((await read_answer(reader))[2]) == {"body": 10}
            writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await within(reader.readuntil(b"first\n"))
            async with connect(f"ws://127.0.0.1:{proxy.port}/ws") as ws:
                await a_header_timeout_passes(proxy)  # with the stream still open too
                await ws.send("still there")
                assert await within(ws.recv()) == "echo:still there"
            upstream.more.set()
            await within(reader.readuntil(b"last\n"))
        finally:
            writer.close()


# ---------------------------------------------------------------------------------------------
# Connection cap


async def test_connections_past_the_cap_get_503_while_a_stream_and_a_websocket_go_on() -> None:
    async with served(InboundLimits(max_connections=2), through_proxy=True) as (proxy, upstream):
        reader, writer = await open_to(proxy)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await within(reader.readuntil(b"first\n"))
        async with connect(f"ws://127.0.0.1:{proxy.port}/ws") as ws:
            status, headers, body, rest = await exchange(proxy, request())
            assert status == 503 and headers["connection"] == "close" and rest == b""
            assert json.loads(body)["fix"]
            await ws.send("after the refusal")
            assert await within(ws.recv()) == "echo:after the refusal", "an open websocket is never cut"
        upstream.more.set()
        await within(reader.readuntil(b"last\n"))
        writer.close()
        async with asyncio.timeout(SAFETY_S):  # the closed connections leave the count as their close is seen
            await poll_until(lambda: len(proxy.server.server_state.connections) < 2)
        assert (await exchange(proxy, request()))[0] == 200, "a connection must be accepted again once others closed"


async def test_at_the_cap_connections_without_a_request_head_make_room_for_real_requests() -> None:
    """A slowloris that reconnects as soon as it is cut keeps more half-open connections than the
    cap; every real request is still served (issue 25: 5 of 66 were)."""
    cap = 8
    async with served(InboundLimits(max_connections=cap)) as (server, _upstream):
        stop = asyncio.Event()
        cut = 0
        writers: list[asyncio.StreamWriter] = []

        async def slowloris() -> None:
            nonlocal cut
            while not stop.is_set():
                try:
                    reader, writer = await open_to(server)
                    writers.append(writer)
                    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")  # never finished
                    await reader.read()  # until the proxy closes it
                    cut += 1
                    writer.close()
                except (ConnectionError, OSError):
                    cut += 1
                    await asyncio.sleep(0)

        holders = [asyncio.ensure_future(slowloris()) for _ in range(cap + 4)]
        try:
            async with asyncio.timeout(SAFETY_S):  # the listener at its cap, half-open connections reconnecting
                await poll_until(lambda: len(server.server.server_state.connections) >= cap and cut > 0)
            statuses = [(await exchange(server, request()))[0] for _ in range(30)]
        finally:
            stop.set()
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            for writer in writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        assert statuses.count(200) == 30, f"real requests refused while half-open ones held the cap: {statuses}"
        assert cut > 0, "the half-open connections were shed to make room"


async def test_at_the_cap_with_every_connection_mid_request_a_new_one_is_still_refused() -> None:
    async with served(InboundLimits(max_connections=2)) as (server, upstream):
        streams = []
        for _ in range(2):
            reader, writer = await open_to(server)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await within(reader.readuntil(b"first\n"))
            streams.append(writer)
        status = (await exchange(server, request()))[0]
        assert status == 503, "connections that sent a whole head are never shed"
        upstream.more.set()
        for writer in streams:
            writer.close()


# ---------------------------------------------------------------------------------------------
# Failed accepts


async def test_failed_accepts_are_logged_once_per_interval_without_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pass

    server = await start_server(app, name="plain")
    try:
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.ERROR):
            for _ in range(1000):
                loop.call_exception_handler({"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files"),
                                             "socket": server.server.servers[0].sockets[0]})
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    finally:
        await server.stop()
    accept_lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(accept_lines) == 1 and accept_lines[0].exc_info is None, [r.getMessage() for r in accept_lines]
    assert "Too many open files" in accept_lines[0].getMessage()
    assert any(r.getMessage() == "something else" for r in caplog.records), "other loop errors still get logged"


CHILD = """
import asyncio, contextlib, os, resource, sys
sys.path.insert(0, {root!r})
from proxy.relay.servers import start_server
from proxy.tasks import poll_until

asyncio.constants.ACCEPT_RETRY_DELAY = 0.05  # asyncio retries a failed accept every second: here, 20 times as often

async def app(scope, receive, send):
    pass

async def main():
    server = await start_server(app, name="tight")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    print(server.port, flush=True)
    throttle = asyncio.get_running_loop().get_exception_handler().throttle
    with contextlib.suppress(TimeoutError):  # until three retries were held back (at most 5 s)
        async with asyncio.timeout(5):
            await poll_until(lambda: throttle._held >= 3, every_s=0.05)
    print("held", throttle._held, flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
async def test_a_listener_out_of_descriptors_logs_one_line_not_a_traceback_per_retry() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD.format(root=str(ROOT)), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    clients: list[asyncio.StreamWriter] = []
    try:
        assert child.stdout is not None
        port = int(await within(child.stdout.readline()))
        for _ in range(12):
            _, writer = await asyncio.open_connection("127.0.0.1", port)  # the backlog accepts them all
            clients.append(writer)
        out, err = await within(child.communicate())
        stderr = err.decode()
    finally:
        for writer in clients:
            writer.close()
        if child.returncode is None:
            child.kill()
            await child.wait()
    said = out.decode().split()
    assert said[0] == "held" and int(said[1]) >= 3, f"asyncio did not retry the failed accept: {out!r} {stderr}"
    lines = [line for line in stderr.splitlines() if "accept" in line]
    assert len(lines) == 1 and "Too many open files" in lines[0], stderr
    assert "Traceback" not in stderr, stderr
