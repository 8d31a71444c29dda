"""The answer side of `http1`: one upstream answer, parsed by httptools as it arrives (status,
headers, then the raw body), and the errors an answer can end in.

`Response` is what `Pool.request` returns once the status and headers are in. Its parser callbacks
(`on_*`) run inside the connection's `data_received`; the reader (`aiter_raw`, `aread`,
`received_body`) takes what arrived. The rules it keeps (1xx skipped, trailers dropped, a transfer
coding other than chunked or a 101 refused, bytes past the end never reused, an early answer to a
body still being sent) are in `http1`'s docstring.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import httptools
from starlette.datastructures import Headers

RawHeaders = list[tuple[bytes, bytes]]

READ_BUFFER_HIGH = 1 << 20  # pause reading the upstream when this much body waits for a slow client


class _Timeouts(Protocol):
    @property
    def read_s(self) -> float | None: ...


class Carrier(Protocol):
    """What an answer needs of the connection it arrives on (`http1`'s `_Connection`)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    @property
    def pool(self) -> _Timeouts: ...

    def release(self) -> None:
        """The exchange ended cleanly: back to the pool."""

    def drop(self) -> None:
        """The exchange did not end cleanly: closed, so the upstream sees it."""


class Receiver(Protocol):
    """What a connection hands the bytes of the answer it carries to (a `Response`, or inline.py's
    exchange until it hands them to one)."""

    def _feed(self, data: bytes) -> None: ...

    def _connection_lost(self, exc: BaseException | None) -> None: ...


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before its answer ended."""


class UpstreamProtocolError(ConnectionError):
    """The upstream's answer is not valid HTTP/1.1, or not one this relay can pass on."""



_FRAMING = frozenset({b"content-length", b"transfer-encoding"})  # a body framed: an EOF before its end truncates it


class _StopParsing(Exception):
    """Raised in a parser callback to stop httptools at once; the reason is already recorded."""


class Response:
    """An answer whose status and headers are in; the body is read with `aiter_raw`, `aread` or
    `received_body`, and `close()` must be called once (it returns the connection to the pool
    only when the exchange ended cleanly)."""

    __slots__ = (
        "__weakref__",
        "_body_task",
        "_buffered",
        "_chunks",
        "_closed",
        "_coded",
        "_complete",
        "_conn",
        "_error",
        "_feeding",
        "_framed",
        "_head",
        "_head_cb",
        "_head_only",
        "_in_head",
        "_interim",
        "_keep_alive",
        "_parser",
        "_stray",
        "_waiter",
        "got_bytes",
        "raw_headers",
        "status_code",
    )

    def __init__(self, conn: Carrier, *, head_only: bool) -> None:
        self.status_code = 0
        self.raw_headers: RawHeaders = []  # names lower-cased, repeats kept in order
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: BaseException | None = None
        self._interim = False
        self._framed = False  # Content-Length or Transfer-Encoding in the head: an EOF before the end is a truncation
        self._coded = False  # Transfer-Encoding in the head
        self._keep_alive = False
        self._head_only = head_only
        self._closed = False
        self._stray = False  # the parser met bytes past the end of our answer
        self._in_head = False  # between the start of an answer and the end of its headers
        self._body_task: asyncio.Task[None] | None = None
        self._head_cb: Callable[[asyncio.Future[None]], object] | None = None
        self._feeding = False
        self.got_bytes = False

    def on_head(self, callback: Callable[[asyncio.Future[None]], object]) -> None:
        """Call `callback` once the status and headers are in, or the answer failed first (the
        future's exception says how): `Pool.send_now`'s answer, which no coroutine awaits. An answer
        whole (or failed) by the end of the read that brought its head is handed over at once, in
        that read's callback; else from the loop's next turn, as a future's done callback runs (the
        rest of a small body sent in a write of its own is usually in by then): no handle, no loop
        turn for the usual small answer."""
        self._head_cb = callback

    def _head_due(self) -> None:
        callback, self._head_cb = self._head_cb, None
        if callback is None:
            return
        if self._complete or self._error is not None:
            callback(self._head)
        else:
            self._conn.loop.call_soon(callback, self._head)

    @property
    def headers(self) -> Headers:
        """Case-insensitive view; `getlist` keeps repeats."""
        return Headers(raw=self.raw_headers)

    # -- parser callbacks (httptools calls these from feed_data) ----------------------------
    # One packet can hold more than our answer; anything after its end is stray (see _strayed).
    def on_message_begin(self) -> None:
        if self._complete:
            self._strayed()
        else:
            self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools reports a chunked body's trailers here too, after the headers: never ours to add.
        if self._in_head:
            name = name.lower()
            self.raw_headers.append((name, value))
            if name in _FRAMING:
                self._framed = True
                self._coded = self._coded or name == b"transfer-encoding"

    def on_headers_complete(self) -> None:
        if not self._in_head:
            return  # a stray answer's head
        self._in_head = False
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 103 Early Hints: the real answer follows
            self.raw_headers = []
            self._framed = self._coded = False
            return
        # Only a 101 or a transfer coding can make an answer unrelayable; either is rare.
        refusal = _unrelayable(status, self.raw_headers) if status == 101 or self._coded else None
        if refusal is not None:
            self._fail(UpstreamProtocolError(refusal))
            raise _StopParsing  # its body is never read: the connection is dropped with it
        self.status_code = status
        # After a server error the engine may close the connection without saying so, and later
        # than the answer: uvicorn closes it once it has logged the app's traceback, a few ms after
        # Starlette's 500 went out (llama-cpp-python's server; measured, a POST sent meanwhile is
        # lost). A fresh connection costs one connect; a lost POST cannot be retried.
        self._keep_alive = self._parser.should_keep_alive() and status < 500
        if self._head_only:
            # httptools cannot be told the request was HEAD; its answer has no body whatever it declares.
            self._complete = True
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._complete:  # a body on a HEAD answer, or a second answer's
            self._strayed()
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_BUFFER_HIGH and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._stray:
            return
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._keep_alive = self._keep_alive and self._parser.should_keep_alive()
        self._wake()

    def _strayed(self) -> None:
        self._stray = True
        self._keep_alive = False

    # -- fed by the connection --------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self.got_bytes = True
        if self._complete or self._error is not None:
            self._keep_alive = False  # bytes past the end: never reuse this connection
            return
        self._feeding = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._error is None:  # else a callback refused the answer and said why
                if self._complete:
                    self._strayed()  # junk after a whole answer (a body on a 204, bytes after a close) spoils nothing
                elif isinstance(exc, httptools.HttpParserUpgrade):
                    self._fail(UpstreamProtocolError("the upstream switched protocols on a plain request"))
                else:
                    self._fail(UpstreamProtocolError(f"malformed answer from the upstream: {exc}"))
        self._feeding = False
        if self._head_cb is not None and self._head.done():
            self._head_due()  # last: the callback may hand the connection to the next exchange

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._complete or self._error is not None:
            return
        if not self._head.done():
            self._fail(UpstreamClosed("the upstream closed the connection before answering" if exc is None
                                      else f"the upstream reset the connection before answering ({exc})"))
        elif exc is not None:  # a reset is never the end of a body, framed or not
            self._fail(UpstreamClosed(f"the upstream connection broke before the answer ended: {exc}"))
        elif not self._framed:  # no Content-Length, not chunked: the body ends where the connection does
            self._complete = True
            self._keep_alive = False
            self._wake()
        else:
            self._fail(UpstreamClosed("the upstream closed the connection before the answer ended"))

    def _fail(self, exc: BaseException) -> None:
        self._keep_alive = False
        if self._complete and self._error is None:
            return  # the whole answer is in: our upload failing after it (an early 4xx, then a close) spoils nothing
        if self._error is None:
            self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: whoever awaits it re-raises; nobody awaiting is fine too
        self._wake()
        if self._head_cb is not None and not self._feeding:
            self._head_due()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reading ------------------------------------------------------------------------------
    async def _wait_head(self, read_s: float | None) -> None:
        body = self._body_task
        if read_s is not None and body is not None and not body.done():
            # The read timeout counts the upstream's silence after our request; during an upload
            # it owes us nothing (a stalled upload is the write timeout's).
            await asyncio.wait((self._head, body), return_when=asyncio.FIRST_COMPLETED)
            if self._head.done():
                return self._head.result()
        if read_s is None:
            await self._head
        else:
            async with asyncio.timeout(read_s):
                await asyncio.shield(self._head)

    def _take(self) -> bytes:
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > READ_BUFFER_HIGH and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        self._buffered = 0
        return data

    def received_body(self) -> bytes | None:
        """The whole body if the upstream has sent all of it already (the usual small answer), else
        None. It stays the answer's: asked again, the same bytes (an inline exchange that looked at it,
        then handed the answer to a task to relay, lost its body that way: "Response content shorter
        than Content-Length")."""
        if self._complete and self._error is None:
            chunks = self._chunks
            if len(chunks) > 1:
                whole = b"".join(chunks)
                chunks.clear()
                chunks.append(whole)
            return chunks[0] if chunks else b""
        return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (what arrived together is handed over together)."""
        read_s = self._conn.pool.read_s
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._waiter = waiter = self._conn.loop.create_future()
            try:
                if read_s is None:
                    await waiter
                else:
                    async with asyncio.timeout(read_s):
                        await waiter
            finally:
                self._waiter = None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    @property
    def reusable(self) -> bool:
        """The exchange ended cleanly: the whole answer is in, with nothing after it, on a connection
        both sides keep alive, and nothing is still being sent. `close()` gives the connection back then."""
        sending = self._body_task is not None and not self._body_task.done()
        return self._complete and self._keep_alive and not self._stray and self._error is None and not sending

    def close(self) -> None:
        """Back to the pool if the exchange ended cleanly; otherwise the connection is dropped,
        which is how the upstream learns the client went away (Ollama stops generating then)."""
        if self._closed:
            return
        self._closed = True
        if self.reusable:
            self._conn.release()
        else:
            if self._body_task is not None:
                self._body_task.cancel()
            self._conn.drop()
        # The parser holds this answer's callbacks, this answer holds the parser: a cycle that only
        # the collector would free (14 objects per request, and the collections they set off).
        # Nothing feeds a closed answer: its connection was released or dropped above.
        del self._parser

    async def aclose(self) -> None:
        self.close()


def _unrelayable(status: int, headers: RawHeaders) -> str | None:
    """Why an answer cannot be relayed as it is, or None."""
    if status == 101:
        # Upgrade is hop-by-hop: no request we send asks for one, so no 101 can be an answer to it.
        return "the upstream answered 101 Switching Protocols to a request that asked for no upgrade"
    codings = [c.strip().lower() for n, v in headers if n == b"transfer-encoding" for c in v.split(b",")]
    codings = [c for c in codings if c]
    if codings and codings != [b"chunked"]:
        listed = b", ".join(codings).decode("latin-1")
        return f"the upstream used Transfer-Encoding: {listed}; only chunked can be passed on"
    return None
