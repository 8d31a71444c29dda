"""A lean HTTP/1.1 client for relayed requests: one keep-alive pool per upstream, httptools parsing.

Why hand-written: a relay needs only "send these exact bytes, hand back the status, headers and raw
body as they arrive", and the general clients pay for much more on every request (cookies,
redirects, auto headers, decoding, tracing, per-request timer objects). On the 2-core bench box,
aiohttp's `ClientSession.request` was ~40 % of the proxy's CPU per small GET and httpx's twice that
(bench/forwarding.py, py-spy). Parsing is httptools (llhttp, the parser uvicorn uses), so framing,
chunked decoding and keep-alive rules are not ours. Here: the pool, its connections and the sending
of a request; one answer as it is parsed and read (`Response`, the errors it ends in) is
`http1_answer.py`, re-exported here.

What it does and does not do:
- Requests go out byte for byte as given (the caller owns every header); a streamed body goes
  chunked unless the caller passed a Content-Length. Interim 1xx answers are skipped.
- The body is never decoded: chunked framing is removed, Content-Encoding is left alone. Trailers
  after a chunked body are dropped (an ASGI server has no way to send them on).
- An answer this relay cannot pass on is an UpstreamProtocolError (502 at the listener): a 101 to
  a request that asked for no upgrade, and a transfer coding other than chunked (`gzip, chunked`).
  The latter is refused, not relayed: the ASGI server frames the client's answer itself, so the
  coding could only be dropped (the client would get gzip bytes labelled as plain) or turned into
  a Content-Encoding, which changes what the body's validators and ranges refer to.
- Connections per upstream are capped (max_connections, in use, idle or being dialled); a request
  that finds none free waits its turn, first come first served, up to pool_s, then PoolTimeout.
  Idle connections are closed by a timer once idle_expiry_s passes, not only when the next
  request comes along.
- A pooled connection is looked at before it carries a request: a zero-timeout poll of its socket
  finds a close (or stray bytes) that arrived since the loop last ran, and a fresh connection is
  used instead. The poll is one call on a poller the connection registered once (building one per
  look, with the socket looked up each time, was ~2 % of the relay's busy time under load). `send_now`
  does not look: its GET, met by a close before any answer byte, is served again from the start
  (inline.py), and the poll, a syscall, was 4 % of the relay's CPU per small GET. A
  connection that answered 5xx is not pooled at all: engines close it after a
  server error without saying so, a few ms after the answer (uvicorn after Starlette's 500).
- A pooled connection that still turns out closed before any answer byte is retried once, on a new
  connection, only for idempotent methods with a replayable (bytes) body: a POST that reached the
  engine before the close must not run twice (a second generation, a second queued prompt).
- Timeouts: connect; read (no byte for that long: waiting for the head once the request is sent,
  or between body chunks); write (a stalled upload). None means wait forever (a model load is
  silent for minutes).
  They are `asyncio.timeout` blocks, not `wait_for`: on 3.11, `wait_for` can swallow a
  cancellation that lands as its future completes, and a cancellation is how a departed client
  stops its relay.
- Bytes after the end of an answer (a second answer, a body on a HEAD or 204 answer, junk) are
  ignored and the connection is not reused: they cannot belong to any request we sent.
- An answer that comes while a big body is still being sent (an early 4xx) is returned at once;
  the connection is then dropped, not reused. If the engine never reads the rest, write_s (off by
  default) ends the exchange, even mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar, cast
from urllib.parse import urlsplit

from proxy.relay.http1_answer import READ_BUFFER_HIGH as READ_BUFFER_HIGH
from proxy.relay.http1_answer import RawHeaders as RawHeaders
from proxy.relay.http1_answer import Receiver as Receiver
from proxy.relay.http1_answer import Response as Response
from proxy.relay.http1_answer import UpstreamClosed as UpstreamClosed
from proxy.relay.http1_answer import UpstreamProtocolError as UpstreamProtocolError

Body = bytes | AsyncIterator[bytes] | None

# Below aiohttp's (ComfyUI's server) 75 s keep-alive, so we drop an idle connection before the
# engine does instead of racing its close with our next request.
IDLE_EXPIRY_S = 60.0
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})  # RFC 9110 9.2.2
# A local engine serves a handful of requests at once (Ollama's OLLAMA_NUM_PARALLEL); beyond this
# many connections a burst queues here instead of costing a socket (two descriptors) per request.
MAX_CONNECTIONS = 1024
POOL_WAIT_S = 30.0  # how long a request waits for a free connection when the tenant sets no pool_s


R = TypeVar("R", bound=Receiver)


class PoolTimeout(TimeoutError):
    """Every connection to the upstream stayed busy for as long as a request may wait for one."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.response: Receiver | None = None  # the answer being received, if any
        self.lost = False
        self.counted = False  # holds one of the pool's max_connections slots until it is retired
        self.idle_since = 0.0
        self._poller: select.poll | None = None  # registered on the socket at the first look (readable)
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.drop()  # bytes on an idle connection (an idle timeout notice): the server is closing it
            return
        self.response._feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._forget(self)
        self.pool._retire(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(UpstreamClosed("the upstream closed the connection while we were sending"))
            self._drained.exception()
        if self.response is not None:
            self.response._connection_lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- used by the pool and the response ----------------------------------------------------
    @property
    def write_blocked(self) -> bool:
        """The transport holds more than its high-water mark of unsent bytes."""
        return self._write_paused

    @property
    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def readable(self) -> bool:
        """Whether the socket of this idle connection has something to read: the upstream's close
        (EOF or a reset) or bytes nobody asked for; either way it must carry no request. asyncio
        reads a socket only when the loop runs, so a close that came since is in the socket, not
        yet seen here; a zero-timeout poll of the socket finds it (what urllib3 and httpcore do
        before reusing a connection)."""
        poller = self._poller
        try:
            if poller is None:  # the first look: most connections are reused, so it is registered once
                sock = self.transport.get_extra_info("socket") if self.transport is not None else None
                if sock is None:
                    return False
                if not hasattr(select, "poll"):
                    readable, _, errored = select.select([sock], [], [sock], 0)
                    return bool(readable or errored)
                poller = self._poller = select.poll()
                poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True  # a socket that cannot be polled is no socket to send on

    async def drain(self) -> None:
        if self.lost:
            raise UpstreamClosed("the upstream closed the connection while we were sending")
        if not self._write_paused:
            return
        self._drained = self.loop.create_future()
        try:
            write_s = self.pool.write_s
            async with asyncio.timeout(write_s):  # None: no limit
                await self._drained
        finally:
            self._drained = None

    def release(self) -> None:
        self.response = None
        if self.transport is not None:
            self.transport.resume_reading()
        self.pool._release(self)

    def drop(self) -> None:
        self.response = None
        if self.transport is not None:
            self.transport.abort()
        self.pool._retire(self)


Connection = _Connection  # a pooled connection, as `Pool.send_now` hands it to its receiver


class Pool:
    """Keep-alive connections to one upstream (`http://host:port` or `https://...`), used LIFO,
    at most max_connections at once."""

    def __init__(self, upstream: str, *, connect_s: float | None = 5.0, read_s: float | None = None,
                 write_s: float | None = None, ssl_context: ssl.SSLContext | None = None,
                 max_idle: int = 256, idle_expiry_s: float = IDLE_EXPIRY_S,
                 max_connections: int = MAX_CONNECTIONS, pool_s: float | None = POOL_WAIT_S) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) upstream: {upstream!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.connect_s, self.read_s, self.write_s, self.pool_s = connect_s, read_s, write_s, pool_s
        self.max_idle, self.idle_expiry_s = max_idle, idle_expiry_s
        self.max_connections = max_connections
        self._idle: deque[_Connection] = deque()  # oldest on the left; taken from the right
        self._open = 0  # slots taken: connections open or being dialled, and slots handed to a waiter
        # Requests waiting for a connection, first come first served. A waiter is handed a free
        # connection, or None: a slot of its own to dial with.
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._reaper: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(self, method: str, target: bytes, headers: RawHeaders, body: Body) -> Response:
        """Send one request; return when the answer's status and headers are in (body unread).
        Raises OSError (refused, reset, UpstreamClosed, UpstreamProtocolError) or TimeoutError
        (PoolTimeout when no connection came free in time)."""
        streamed = body is not None and not isinstance(body, bytes)
        has_length = streamed and any(k.lower() == b"content-length" for k, _ in headers)
        head = request_head(method, target, headers, chunked=streamed and not has_length)
        replayable = not streamed and method in IDEMPOTENT
        for attempt in (1, 2):
            conn, reused = await self._acquire(fresh=attempt > 1)
            response = conn.response = Response(conn, head_only=method == "HEAD")
            assert conn.transport is not None
            try:
                if streamed:
                    conn.transport.write(head)
                    response._body_task = asyncio.ensure_future(
                        _send_body(conn, response, body, chunked=not has_length))  # type: ignore[arg-type]
                else:
                    conn.transport.write(head + body if body else head)  # type: ignore[operator]
                    if conn.write_blocked:
                        # A big replayed body still going out. The engine may answer before reading it
                        # (Go answers a 4xx and closes with 256 KiB unread), so wait for both at once.
                        response._body_task = asyncio.ensure_future(_finish_sending(conn, response))
                await response._wait_head(self.read_s)
                return response
            except UpstreamClosed:
                response.close()
                # A kept-alive connection the upstream closed meanwhile: one fresh try if nothing was answered.
                if attempt == 1 and reused and replayable and not response.got_bytes:
                    continue
                raise
            except BaseException:
                response.close()
                raise
        raise AssertionError("unreachable")

    def send_now(self, head: bytes, receiver: Callable[[Connection], R]) -> R | None:
        """A bodiless GET, its whole head given (`request_head`), sent at once on an idle connection,
        with no coroutine; its answer goes to `receiver(connection)`, which makes it a `Response` or
        handles it itself (inline.py). No retry: the caller sends it again through `request` when it
        fails before any byte came. None: no idle connection, or a read timeout to keep (only
        `request` keeps timers); nothing was sent."""
        if self.read_s is not None:
            return None
        conn = self._take_idle(look=False)
        if conn is None or conn.transport is None:
            return None
        taken = receiver(conn)
        conn.response = taken
        conn.transport.write(head)
        return taken

    # -- connections and slots --------------------------------------------------------------------
    async def _acquire(self, *, fresh: bool = False) -> tuple[_Connection, bool]:
        """A connection for one exchange, and whether it was used before. `fresh`: a new one (a
        retry after a stale pooled connection must not meet another stale one)."""
        while True:
            if not fresh:
                conn = self._take_idle()
                if conn is not None:
                    return conn, True
            if self._open < self.max_connections and not self._waiters:
                self._open += 1
                return await self._dial(), False
            handed = await self._wait_turn()
            if handed is None:
                return await self._dial(), False
            if handed.usable and not fresh and not handed.readable():
                return handed, True
            if handed.counted:  # a retry wants a new one: keep its slot to dial with
                handed.counted = False
                handed.drop()
                return await self._dial(), False
            # Closed by the upstream before we got to it, its slot freed with it: wait again.

    def _take_idle(self, *, look: bool = True) -> _Connection | None:
        """The most recently used idle connection that is still open; `look`: polled first (`readable`)."""
        while self._idle:
            conn = self._idle.pop()
            # conn.loop, not asyncio.get_running_loop(): on 3.11 that is a getpid() syscall per call.
            if conn.usable and conn.loop.time() - conn.idle_since < self.idle_expiry_s \
                    and not (look and conn.readable()):
                return conn
            conn.drop()
        return None

    async def _dial(self) -> _Connection:
        """Open a connection in a slot the caller holds; a failure gives the slot back."""
        loop = asyncio.get_running_loop()
        made: list[_Connection] = []

        def protocol() -> _Connection:
            conn = _Connection(self, loop)
            conn.counted = True  # the slot is the connection's from now on
            made.append(conn)
            return conn

        try:
            connecting = loop.create_connection(protocol, self.host, self.port, ssl=self.ssl)
            async with asyncio.timeout(self.connect_s):  # None: no limit
                _, conn = await connecting
        except BaseException:
            if made:
                made[0].drop()
            else:
                self._free_slot()
            raise
        if not conn.usable:  # closed by the upstream before we got to it
            conn.drop()
            raise UpstreamClosed("the upstream closed the connection as soon as it was opened")
        return conn

    async def _wait_turn(self) -> _Connection | None:
        """Wait for a free connection or slot (first come first served), at most pool_s."""
        turn: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            async with asyncio.timeout(self.pool_s):  # None: no limit
                return await turn
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                self._pass_on(turn.result())  # handed over just as we gave up: the next waiter's
            else:
                turn.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(turn)
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(f"all {self.max_connections} connections to {self.host}:{self.port} stayed busy "
                                  f"for {self.pool_s:g} s") from None
            raise

    def _hand_over(self, conn: _Connection | None) -> bool:
        """Give a free connection (or, with None, a slot) to the longest waiter; False if none waits."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(conn)
                return True
        return False

    def _pass_on(self, conn: _Connection | None) -> None:
        if conn is None:
            self._free_slot()
        else:
            self._release(conn)

    def _free_slot(self) -> None:
        if not self._hand_over(None):
            self._open -= 1

    def _retire(self, conn: _Connection) -> None:
        """A connection is gone (dropped or closed by the upstream): its slot is free, once."""
        if conn.counted:
            conn.counted = False
            self._free_slot()

    def _release(self, conn: _Connection) -> None:
        if self._closed or not conn.usable:
            conn.drop()
            return
        if self._hand_over(conn):
            return
        if len(self._idle) >= self.max_idle:
            conn.drop()
            return
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)
        if self._reaper is None:
            self._reaper = conn.loop.call_later(self.idle_expiry_s, self._reap)

    def _reap(self) -> None:
        """Close the connections idle for idle_expiry_s (the oldest are on the left), then wait for the next."""
        self._reaper = None
        if not self._idle:
            return
        loop = self._idle[0].loop
        now = loop.time()
        while self._idle and now - self._idle[0].idle_since >= self.idle_expiry_s:
            self._idle.popleft().drop()
        if self._idle and not self._closed:
            delay = max(self._idle[0].idle_since + self.idle_expiry_s - now, 0.0)
            self._reaper = loop.call_later(delay, self._reap)

    def _forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    @property
    def open_connections(self) -> int:
        """Connections open or being dialled (and slots handed to a waiter about to dial)."""
        return self._open

    def close(self) -> None:
        """Close the idle connections; those in use close when their answer is closed."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        while self._idle:
            self._idle.pop().drop()


def request_head(method: str, target: bytes, headers: RawHeaders, *, chunked: bool = False) -> bytes:
    """A request's head, the headers as given (one format per line and one join: the cheapest way)."""
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), target), *[b"%s: %s" % h for h in headers]]
    if chunked:
        lines.append(b"transfer-encoding: chunked")
    lines += (b"", b"")
    return b"\r\n".join(lines)


async def _finish_sending(conn: _Connection, response: Response) -> None:
    """Wait for a replayed body's tail to leave (write_s); a failure ends the exchange unless the
    answer is already whole."""
    try:
        await conn.drain()
    except Exception as exc:
        response._fail(exc)
        conn.drop()


async def _send_body(conn: _Connection, response: Response, body: AsyncIterator[bytes], *, chunked: bool) -> None:
    """Stream a request body upstream with back-pressure; any failure ends the whole exchange."""
    try:
        async for chunk in body:
            if not chunk or conn.transport is None:
                continue
            if chunked:
                conn.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            else:
                conn.transport.write(chunk)
            await conn.drain()
        if chunked and conn.transport is not None:
            conn.transport.write(b"0\r\n\r\n")
    except Exception as exc:
        # The client's upload broke (it went away) or the upstream stopped reading: the upstream must
        # see an aborted request, never a short body presented as whole.
        response._fail(exc)
        conn.drop()
