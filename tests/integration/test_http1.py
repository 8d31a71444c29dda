"""The relay's HTTP/1.1 client against a raw socket server that answers exactly the bytes a test gives."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.clock import until_all_wait
from proxy.relay.http1 import Pool, PoolTimeout, UpstreamClosed, UpstreamProtocolError
from proxy.tasks import poll_until

SAFETY_S = 5.0

# The test's handler gets each request as (head, body) and writes what it wants.
Handler = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.eofs = 0  # connections the client ended (closed or reset)
        self.server: asyncio.Server | None = None
        self.reader: asyncio.StreamReader | None = None  # the connection being served

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.reader = reader
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    body = await _read_body(reader, head)
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                self.requests.append((head, body))
                await self.handler(head, body, writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return out
            out += chunk[:-2]
    for line in lower.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":")[1]))
    return b""


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[RawServer]:
    server = RawServer(handler)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.server.close()


def answer(raw: bytes, *, then_close: bool = False) -> Handler:
    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()
        if then_close:
            writer.close()
    return handler


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def get(pool: Pool, path: bytes = b"/", method: str = "GET", body: bytes | AsyncIterator[bytes] | None = None,
              headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    response = await asyncio.wait_for(pool.request(method, path, headers or [(b"host", b"upstream")], body), SAFETY_S)
    try:
        data = await asyncio.wait_for(response.aread(), SAFETY_S)
    finally:
        response.close()
    return response.status_code, response.raw_headers, data


async def test_keep_alive_connection_is_reused_for_the_next_request() -> None:
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url)
        assert (await get(pool))[2] == b"ok"
        assert (await get(pool))[2] == b"ok"
        pool.close()
    assert up.connections == 1, "a kept-alive answer must leave its connection for the next request"


async def test_request_goes_out_byte_for_byte() -> None:
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url)
        await get(pool, b"/a%2Fb?q=%20x&y", method="DELETE", body=b'{"name":"m"}',
                  headers=[(b"Host", b"127.0.0.1:11434"), (b"X-Custom", b"1"), (b"content-length", b"12")])
        pool.close()
    head, body = up.requests[0]
    assert head.startswith(b"DELETE /a%2Fb?q=%20x&y HTTP/1.1\r\n"), head
    assert b"Host: 127.0.0.1:11434\r\nX-Custom: 1\r\ncontent-length: 12\r\n\r\n" in head
    assert body == b'{"name":"m"}'


async def test_interim_100_continue_is_skipped() -> None:
    async with raw_server(answer(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)) as up:
        pool = Pool(up.url)
        status, _, body = await get(pool)
        pool.close()
    assert (status, body) == (200, b"ok")


async def test_head_answer_declaring_a_length_has_no_body_and_keeps_the_connection() -> None:
    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" if head.startswith(b"HEAD") else OK)
    async with raw_server(handler) as up:
        pool = Pool(up.url)
        status, headers, body = await get(pool, method="HEAD")
        assert (status, body, dict(headers)[b"content-length"]) == (200, b"", b"5")
        assert (await get(pool))[2] == b"ok", "the answer after a HEAD must be read from the right bytes"
        pool.close()
    assert up.connections == 1


async def test_body_without_length_ends_when_the_upstream_closes() -> None:
    async with raw_server(answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", then_close=True)) as up:
        pool = Pool(up.url)
        assert (await get(pool))[2] == b"until the end"
        assert pool.idle_connections == 0, "a connection-close answer must not go back to the pool"
        pool.close()


async def test_truncated_body_is_an_error_not_a_short_answer() -> None:
    async with raw_server(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", then_close=True)) as up:
        pool = Pool(up.url)
        with pytest.raises(UpstreamClosed):
            await get(pool)
        pool.close()


async def test_chunked_answer_is_unframed_and_repeated_headers_kept() -> None:
    raw = (b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n")
    async with raw_server(answer(raw)) as up:
        pool = Pool(up.url)
        _, headers, body = await get(pool)
        pool.close()
    assert body == b"onetwo"
    assert [v for k, v in headers if k == b"set-cookie"] == [b"a=1", b"b=2"]


async def test_connection_closed_while_idle_is_retried_once_on_a_fresh_one() -> None:
    # The upstream answers keep-alive but closes the socket right after (as an idle timeout would).
    async with raw_server(answer(OK, then_close=True)) as up:
        pool = Pool(up.url)
        await get(pool)
        await _until(lambda: pool.idle_connections == 0)  # the close reaches us while the connection sits in the pool
        assert (await get(pool, body=b"x", method="POST", headers=[(b"host", b"h"), (b"content-length", b"1")]))[2] == b"ok"
        pool.close()
    assert up.connections == 2


async def test_streamed_body_without_length_goes_chunked_with_length_goes_raw() -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b"hello "
        yield b""
        yield b"world"
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url)
        await get(pool, method="POST", body=parts())
        await get(pool, method="PUT", body=parts(), headers=[(b"host", b"h"), (b"content-length", b"11")])
        pool.close()
    (chunked_head, chunked_body), (raw_head, raw_body) = up.requests
    assert b"transfer-encoding: chunked" in chunked_head and chunked_body == b"hello world"
    assert b"transfer-encoding" not in raw_head and raw_body == b"hello world"


async def test_a_failing_upload_aborts_the_upstream_request() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"partial"
        raise ConnectionResetError("client went away")
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url)
        with pytest.raises(ConnectionResetError):
            await get(pool, method="POST", body=broken())
        await _until(lambda: up.eofs == 1)
        pool.close()
    assert up.requests == [] and up.eofs == 1, "the upstream must see the request end without a complete body"


async def test_malformed_answer_is_a_protocol_error() -> None:
    async with raw_server(answer(b"SMTP ready\r\n\r\n")) as up:
        pool = Pool(up.url)
        with pytest.raises(UpstreamProtocolError):
            await get(pool)
        pool.close()


async def test_read_timeout_applies_to_the_head() -> None:
    async def silent(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(SAFETY_S)  # hangs: an upstream that never answers (a fake, no threshold)
    async with raw_server(silent) as up:
        pool = Pool(up.url, read_s=0.05)
        with pytest.raises(TimeoutError):
            await get(pool)
        pool.close()


async def test_refused_connection_is_an_os_error() -> None:
    async with raw_server(answer(OK)) as up:
        url = up.url
    with pytest.raises(OSError):
        await get(Pool(url))


async def test_closing_an_unfinished_answer_drops_the_connection() -> None:
    # Ollama stops generating only when its request's connection goes away.
    client_left = asyncio.Event()

    async def endless(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ntoken\r\n")
        await writer.drain()
        assert up.reader is not None
        with contextlib.suppress(ConnectionError):
            await up.reader.read()  # b"" once the proxy's side is gone
        client_left.set()

    async with raw_server(endless) as up:
        pool = Pool(up.url)
        response = await pool.request("POST", b"/api/generate", [(b"host", b"h"), (b"content-length", b"0")], b"")
        first = await anext(aiter(response.aiter_raw()))
        response.close()
        await asyncio.wait_for(client_left.wait(), SAFETY_S)
        assert first == b"token" and pool.idle_connections == 0
        pool.close()


def _answer_once_then_close_unanswered(first_answers: int = 1) -> Handler:
    """Each connection answers its first request; a later one on the same connection is read and
    closed without a byte, as an engine whose keep-alive ran out just as the request arrived."""
    served: dict[asyncio.StreamWriter, int] = {}  # held, so no id is reused by a later connection

    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        served[writer] = served.get(writer, 0) + 1
        if served[writer] <= first_answers:
            writer.write(OK)
            await writer.drain()
        else:
            writer.close()
    return handler


async def test_post_on_a_connection_closed_unanswered_is_not_sent_twice() -> None:
    # The engine may have run it: a second generation or a second queued prompt is worse than a 502.
    async with raw_server(_answer_once_then_close_unanswered()) as up:
        pool = Pool(up.url)
        await get(pool)
        with pytest.raises(UpstreamClosed):
            await get(pool, method="POST", body=b"{}", headers=[(b"host", b"h"), (b"content-length", b"2")])
        pool.close()
    assert [h.split(b" ")[0] for h, _ in up.requests] == [b"GET", b"POST"], "the POST must reach the engine once"


def _read_request(conn: socket.socket) -> bytes:
    """One request with a Content-Length body (or none) off a blocking socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head


def _closing_engine(listener: socket.socket, answers: int, may_close: threading.Event, closed: threading.Event,
                    heads: list[bytes]) -> threading.Thread:
    """An engine in a thread with blocking sockets, so it closes while the test's loop is held: it
    answers `answers` requests keep-alive on the first connection, closes it when told (`closed` set
    once it has), then answers one request on a fresh connection. Every request head goes to `heads`."""
    def engine() -> None:
        with listener:
            first, _ = listener.accept()
            with first:
                for _ in range(answers):
                    heads.append(_read_request(first))
                    first.sendall(OK)
                may_close.wait(SAFETY_S)
            closed.set()
            listener.settimeout(SAFETY_S)
            try:
                fresh, _ = listener.accept()
            except TimeoutError:
                return  # no fresh connection came: the test's assertion says why
            with fresh:
                heads.append(_read_request(fresh))
                fresh.sendall(OK)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    return thread


async def test_a_close_that_reached_the_socket_before_the_loop_saw_it_is_found_before_a_post_is_sent() -> None:
    # The engine answers keep-alive (no Connection: close), then closes the connection. The close is
    # in our socket before the next POST, but the event loop has not run since: only a look at the
    # socket itself finds it. A POST sent there is lost (never retried: the engine may have run it).
    listener = socket.create_server(("127.0.0.1", 0))
    may_close, closed = threading.Event(), threading.Event()
    heads: list[bytes] = []
    thread = _closing_engine(listener, 1, may_close, closed, heads)
    pool = Pool(f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        assert (await get(pool))[2] == b"ok"
        may_close.set()
        assert closed.wait(SAFETY_S)  # holds the loop: the engine's FIN reaches our socket unseen
        status, _, body = await get(pool, method="POST", body=b"{}", headers=[(b"host", b"h"), (b"content-length", b"2")])
    finally:
        pool.close()
        thread.join(SAFETY_S)
    assert (status, body) == (200, b"ok"), "the POST must go on a fresh connection, not into the closed one"
    assert [h.split(b" ")[0] for h in heads] == [b"GET", b"POST"], "the POST reached the engine once"


async def test_a_connection_looked_at_before_is_looked_at_again_with_the_same_poller() -> None:
    # The poller is registered at a connection's first reuse and kept: a close before its second reuse
    # must be found by it just the same.
    listener = socket.create_server(("127.0.0.1", 0))
    may_close, closed = threading.Event(), threading.Event()
    heads: list[bytes] = []
    thread = _closing_engine(listener, 2, may_close, closed, heads)
    pool = Pool(f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        assert (await get(pool))[2] == b"ok"
        assert (await get(pool))[2] == b"ok"  # the first reuse: its socket looked at, the poller kept
        assert pool.open_connections == 1
        may_close.set()
        assert closed.wait(SAFETY_S)  # holds the loop: the FIN reaches our socket unseen
        status, _, body = await get(pool, method="POST", body=b"{}", headers=[(b"host", b"h"), (b"content-length", b"2")])
    finally:
        pool.close()
        thread.join(SAFETY_S)
    assert (status, body) == (200, b"ok"), "the POST must go on a fresh connection, not into the closed one"
    assert [h.split(b" ")[0] for h in heads] == [b"GET", b"GET", b"POST"], "the POST reached the engine once"


async def test_idempotent_retry_takes_a_new_connection_not_another_pooled_one() -> None:
    async with raw_server(_answer_once_then_close_unanswered()) as up:
        pool = Pool(up.url)
        await asyncio.gather(get(pool), get(pool))  # two pooled connections, both stale for a second request
        assert pool.idle_connections == 2
        status, _, body = await get(pool)
        pool.close()
    assert (status, body) == (200, b"ok")
    assert up.connections == 3, "the retry must open a connection, not reuse the other stale one"


async def a_read_timeout_passes(read_s: float) -> None:
    """Return once a read timeout of `read_s` has passed for every request already waiting.

    The read timeout is `asyncio.timeout`, the event loop's own timer (the relay's hot path; see
    proxy/relay/http1.py). So rather than sleeping a fixed time, a reference request to an upstream
    that never answers waits for its own TimeoutError: the loop runs timers in deadline order, so
    any read timeout of the same length started before it has fired by then."""
    async with raw_server(_held(asyncio.Event())) as silent:  # the gate never opens
        pool = Pool(silent.url, read_s=read_s)
        with pytest.raises(TimeoutError):
            await get(pool)
        pool.close()


async def test_read_timeout_does_not_run_while_the_upload_is_still_going() -> None:
    # A slow upload is the client's pace; the upstream owes no answer until the body is in.
    async def slow_upload() -> AsyncIterator[bytes]:
        yield b"first "
        await a_read_timeout_passes(0.05)  # the request's head-wait began before this
        yield b"second"
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url, read_s=0.05)
        status, _, _ = await get(pool, method="POST", body=slow_upload())
        pool.close()
    assert status == 200 and up.requests[0][1] == b"first second"


async def test_unframed_body_cut_by_a_reset_is_an_error_not_a_whole_answer() -> None:
    async def resets(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()
    async with raw_server(resets) as up:
        pool = Pool(up.url)
        with pytest.raises(OSError):
            await get(pool)
        pool.close()


async def test_bytes_after_the_answer_are_ignored_and_the_connection_not_reused() -> None:
    second = b"HTTP/1.1 500 Internal Server Error\r\nX-Stray: 1\r\nContent-Length: 3\r\n\r\nbad"
    async with raw_server(answer(OK + second)) as up:
        pool = Pool(up.url)
        status, headers, body = await get(pool)
        assert (status, body) == (200, b"ok") and headers == [(b"content-length", b"2")]
        assert pool.idle_connections == 0, "a connection with bytes nobody asked for must not be reused"
        pool.close()


async def test_a_body_on_a_head_answer_is_dropped_with_its_connection() -> None:
    async with raw_server(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")) as up:
        pool = Pool(up.url)
        status, _, body = await get(pool, method="HEAD")
        assert (status, body) == (200, b"")
        assert pool.idle_connections == 0
        pool.close()


@pytest.mark.parametrize("then", ["closes", "stays open"])
async def test_an_early_answer_to_a_big_body_arrives_whole(then: str) -> None:
    # Go's net/http answers a 4xx before reading a body and closes with more than 256 KiB unread;
    # a replayed GPU body is up to replay_body_max_mb (16 MiB) of bytes.
    done = asyncio.Event()

    async def answers_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n\r\ntoo big!")
            await writer.drain()
            if then == "stays open":
                await done.wait()  # never reads the body
        finally:
            writer.close()

    server = await asyncio.start_server(answers_early, "127.0.0.1", 0)
    pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    body = b"x" * (16 << 20)
    try:
        status, _, answer_body = await get(pool, method="POST", body=body,
                                           headers=[(b"host", b"h"), (b"content-length", b"%d" % len(body))])
        assert (status, answer_body) == (413, b"too big!")
        assert pool.idle_connections == 0, "a connection with an unsent body tail is never reused"
    finally:
        done.set()
        pool.close()
        server.close()


@pytest.mark.parametrize("raw, expected", [
    (OK + b"JUNK\r\n", (200, b"ok")),  # not HTTP at all after a kept-alive answer
    (b"HTTP/1.1 204 No Content\r\n\r\n{}", (204, b"")),  # a body on an answer that has none
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok\r\n", (200, b"ok")),  # after a closing answer
], ids=["junk", "body-on-204", "after-close"])
async def test_malformed_bytes_after_a_whole_answer_spoil_nothing(raw: bytes, expected: tuple[int, bytes]) -> None:
    async with raw_server(answer(raw)) as up:
        pool = Pool(up.url)
        status, _, body = await get(pool)
        assert (status, body) == expected
        assert pool.idle_connections == 0
        pool.close()


# ---------------------------------------------------------------------------------------------
# Connections per upstream: a cap, a bounded wait for a free one, idle ones reaped on a timer


async def _until(pred: Callable[[], bool]) -> None:
    await asyncio.wait_for(poll_until(pred), SAFETY_S)


def _held(gate: asyncio.Event) -> Handler:
    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()
    return handler


async def test_connections_per_upstream_are_capped_and_a_request_waits_its_turn() -> None:
    gate = asyncio.Event()
    async with raw_server(_held(gate)) as up:
        pool = Pool(up.url, max_connections=2)
        requests = [asyncio.ensure_future(get(pool)) for _ in range(3)]
        await _until(lambda: len(up.requests) == 2)
        await until_all_wait()  # room for a third connection to be dialled, if anything would dial it
        assert up.connections == 2 and pool.open_connections == 2, "a third connection was opened past the cap"
        gate.set()
        answers = await asyncio.gather(*requests)
        pool.close()
    assert [body for _, _, body in answers] == [b"ok"] * 3
    assert up.connections == 2, "the waiting request must be served on a connection that came free"


async def test_waiting_for_a_free_connection_is_bounded() -> None:
    gate = asyncio.Event()
    async with raw_server(_held(gate)) as up:
        pool = Pool(up.url, max_connections=1, pool_s=0.05)
        first = asyncio.ensure_future(get(pool))
        await _until(lambda: len(up.requests) == 1)
        with pytest.raises(PoolTimeout):
            await get(pool)
        gate.set()
        assert (await first)[2] == b"ok"
        assert (await get(pool))[2] == b"ok", "a request that gave up must leave no slot taken"
        pool.close()
    assert up.connections == 1


async def test_a_waiter_cancelled_as_a_connection_is_handed_to_it_passes_it_on() -> None:
    # A client that leaves while its request waits for a connection must not take the connection with it.
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url, max_connections=1)
        holding = await pool.request("GET", b"/", [(b"host", b"h")], None)
        await holding.aread()
        waiting = asyncio.ensure_future(pool.request("GET", b"/", [(b"host", b"h")], None))  # no wait_for task between
        await _until(lambda: bool(pool._waiters))
        holding.close()  # hands the connection to the waiter's turn...
        waiting.cancel()  # ...which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (pool.open_connections, pool.idle_connections) == (1, 1), "the connection must go back to the pool"
        assert (await get(pool))[2] == b"ok"
        pool.close()
    assert up.connections == 1


async def test_a_connection_handed_to_a_waiter_and_closed_before_it_resumes_is_not_used() -> None:
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url, max_connections=1)
        holding = await pool.request("GET", b"/", [(b"host", b"h")], None)
        await holding.aread()
        conn = holding._conn
        assert isinstance(conn, asyncio.Protocol)  # the pooled connection is the transport's protocol
        waiting = asyncio.ensure_future(get(pool))
        await _until(lambda: bool(pool._waiters))
        holding.close()  # hands the connection to the waiter...
        conn.connection_lost(None)  # ...and the upstream closes it before the waiter runs
        assert (await waiting)[2] == b"ok"
        assert pool.open_connections == 1
        pool.close()
    assert up.connections == 2


async def test_many_waiters_leaving_leave_no_slot_taken() -> None:
    gate = asyncio.Event()
    async with raw_server(_held(gate)) as up:
        pool = Pool(up.url, max_connections=2)
        held = [asyncio.ensure_future(get(pool)) for _ in range(2)]
        await _until(lambda: len(up.requests) == 2)
        leaving = [asyncio.ensure_future(get(pool)) for _ in range(10)]
        await _until(lambda: len(pool._waiters) == 10)
        for task in leaving[::2]:
            task.cancel()
        gate.set()
        await asyncio.gather(*held, *leaving[1::2])
        await asyncio.gather(*leaving[::2], return_exceptions=True)
        assert pool.open_connections == 2 and pool.idle_connections == 2
        pool.close()
    assert up.connections == 2


async def test_idle_connections_are_closed_by_a_timer_without_a_next_request() -> None:
    async with raw_server(answer(OK)) as up:
        pool = Pool(up.url, idle_expiry_s=0.05)
        await asyncio.gather(get(pool), get(pool))
        assert pool.idle_connections == 2
        await _until(lambda: up.eofs == 2)  # the upstream saw both closed, with no request to notice them
        assert (pool.idle_connections, pool.open_connections) == (0, 0)
        assert (await get(pool))[2] == b"ok"
        pool.close()


async def test_a_101_to_a_plain_request_is_a_protocol_error_and_drops_the_connection() -> None:
    raw = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    async with raw_server(answer(raw)) as up:
        pool = Pool(up.url)
        with pytest.raises(UpstreamProtocolError, match="101"):
            await get(pool)
        assert pool.idle_connections == 0 and pool.open_connections == 0
        pool.close()


async def test_a_transfer_coding_other_than_chunked_is_a_protocol_error() -> None:
    import gzip
    packed = gzip.compress(b"hello")
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed)
    async with raw_server(answer(raw)) as up:
        pool = Pool(up.url)
        with pytest.raises(UpstreamProtocolError, match="gzip"):
            await get(pool)
        pool.close()
