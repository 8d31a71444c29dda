"""A passthrough GET run by the listener's protocol itself: no ASGI task, scope, response object or
send coroutine per request.

The usual request on a tenant listener is a small bodiless GET the engine answers at once (a model
list, a status poll, a UI asset). Through the ASGI path each one cost a task, uvicorn's scope and
request cycle, the listener's coroutines, a departure link, an `UpstreamResponse`, a `RelayResponse`
and two `send`s: 3.5 x nginx's CPU per request; with this lane 1.4-1.6 x (`bench/forwarding.py`,
docs/results.md).

As soon as a GET's head is whole, the listener's protocol (`inbound.py`) asks the app
(`TenantApp.start_inline`), before uvicorn builds a scope. The app answers from what it remembers per
request head (what goes upstream, or that this GET cannot run inline); the request goes out at once on
an idle pooled connection (`http1.Pool.send_now`), and the exchange is that connection's receiver:
- a read holding a whole answer whose head bytes the lane parsed before (`InlineLane.whole_answer`)
  goes back in one write with the client head made then: no parse;
- any other read is parsed by a `Response`, as the ASGI path would; an answer whole and small goes
  back in one write (`GuardedHttpProtocol.answer_whole`, uvicorn's framing), and teaches the lane;
- an answer not whole yet, bigger than HEAD_WITH_BODY_MAX, bodiless by status (204, 304) or with
  headers uvicorn would refuse: relayed by a task from the open answer (`TenantApp.relay_opened`);
- an upstream that closed the kept-alive connection before any byte of the answer: the request is
  served again from the start (a GET, never answered: what `Pool.request`'s one retry does);
- any other failure: the error answer `Forwarder.open` gives (502, 504).
A task that takes over gets the scope uvicorn would have built (`GuardedHttpProtocol.request_scope`).
Not taken inline: another method, a body, an upgrade, a request pipelined behind another, a tenant that
sleeps (the wake comes first), the requests the adapter watches (model news, job news, job views), a
refused Host, a read timeout to keep, no idle connection. A client that leaves before the answer drops
the upstream request at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import ASGIApp

from proxy.engines import strip_hop_by_hop
from proxy.memo import remember
from proxy.relay import http1
from proxy.relay.forward import BODILESS, HEAD_WITH_BODY_MAX, UpstreamResponse
from proxy.relay.inbound import AnswerHead, InlineHead, whole_answer_head

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from proxy.relay.inbound import GuardedHttpProtocol

ANSWER_HEADS_MAX = 256  # upstream answer heads whose client head a listener remembers
ANSWER_HEAD_KEY_MAX = 4096  # the largest upstream head (header bytes) remembered: at most ~1 MiB in all
WHOLE_ANSWERS_MAX = 256  # upstream answer heads, as bytes, whose whole answer a listener knows by sight


@dataclass(slots=True)
class InlineLane:
    """What every inline exchange of one listener shares: its ways out of the lane (a request served
    again from the start, an open answer relayed by a task, a failure answered), its end, and what it
    learnt of the upstream's answers."""

    again: ASGIApp
    relay_opened: Callable[[UpstreamResponse], ASGIApp]
    failed: Callable[[Exception], ASGIApp]
    ended: Callable[[], None]
    _heads: dict[tuple[int, tuple[tuple[bytes, bytes], ...]], AnswerHead | None] = field(default_factory=dict)
    _whole: dict[bytes, tuple[AnswerHead, int]] = field(default_factory=dict)

    def answer_head(self, status: int, headers: http1.RawHeaders) -> AnswerHead | None:
        """The client's head of a whole answer with this upstream status and headers (hop-by-hop
        stripped, uvicorn's checks and framing), None where uvicorn would not write it that way;
        remembered per upstream head: an engine answers a poll with the same headers, but for its Date."""
        key = (status, tuple(headers))
        heads = self._heads
        if key in heads:
            return heads[key]
        head = whole_answer_head(status, strip_hop_by_hop(headers))
        if sum(len(n) + len(v) for n, v in headers) <= ANSWER_HEAD_KEY_MAX:
            remember(heads, key, head, ANSWER_HEADS_MAX)
        return head

    def whole_answer(self, data: bytes) -> tuple[AnswerHead, bytes] | None:
        """The client's head and the body of an upstream answer that is all of `data`, when its head's
        bytes are those of an answer this lane parsed before (`learn`); None: parse it."""
        end = data.find(b"\r\n\r\n") + 4
        known = self._whole.get(data[:end]) if end >= 4 else None
        if known is None or len(data) - end != known[1]:
            return None
        return known[0], data[end:]

    def learn(self, data: bytes, answer: AnswerHead, body: bytes) -> None:
        """`data`, one read, was all of an answer the parser found whole, Content-Length framed, on a
        connection kept alive, whose client head is `answer`: the same head bytes will parse the same,
        so an answer with them and a body of that length is known by sight (`whole_answer`). A Date
        header makes an engine's head new each second: one parse a second per kind of answer."""
        head = data[:len(data) - len(body)]
        if answer[1] != len(body) or not head.endswith(b"\r\n\r\n") or len(head) > ANSWER_HEAD_KEY_MAX:
            return
        remember(self._whole, head, (answer, len(body)), WHOLE_ANSWERS_MAX)


class InlineExchange:
    """One passthrough GET in flight on its client's connection, until its answer is out or handed
    to a task; the receiver of its pooled connection's bytes. An answer known by sight goes back
    without a parse (`InlineLane.whole_answer`); any other is parsed by a `Response`, as ever. The
    lane's `ended` is called once, when the exchange is over (inline) or its task ends."""

    __slots__ = ("_conn", "_cycle", "_ended", "_first", "_lane", "_open", "_response", "_server", "request",
                 "upstream")

    def __init__(self, server: GuardedHttpProtocol, cycle: RequestResponseCycle, conn: http1.Connection,
                 lane: InlineLane, request: InlineHead, upstream: bytes) -> None:
        self._server = server
        self._cycle = cycle
        self._conn = conn
        self._lane = lane
        self.request = request  # the request's head, for the scope of a task that takes over
        self.upstream = upstream  # what it sent upstream
        self._ended = lane.ended
        self._open = True
        self._response: http1.Response | None = None  # once the answer is parsed
        self._first: bytes | None = None  # the read being parsed, while it is the answer's first

    # -- the connection's receiver, until a Response takes over ----------------------------------
    def _feed(self, data: bytes) -> None:
        if self._open:
            known = self._lane.whole_answer(data)
            if known is not None and self._server.answer_whole(self._cycle, *known):
                self._detach()
                self._conn.release()
                self._end()
                return
        response = self._parsed()
        self._first = data
        response._feed(data)
        self._first = None

    def _connection_lost(self, exc: BaseException | None) -> None:
        self._parsed()._connection_lost(exc)

    def _parsed(self) -> http1.Response:
        """The answer as a `Response` from now on: it receives the connection's bytes and, once its
        head is in, calls `_answered`."""
        response = self._response = self._conn.response = http1.Response(self._conn, head_only=False)
        response.on_head(self._answered)
        return response

    # -- the answer, parsed ---------------------------------------------------------------------
    def _answered(self, head: asyncio.Future[None]) -> None:
        if not self._open:  # the client left first
            return
        self._detach()
        response, server, cycle, lane = self._response, self._server, self._cycle, self._lane
        assert response is not None
        exc = head.exception() if not head.cancelled() else OSError("the upstream answer was cancelled")
        if exc is not None:
            response.close()
            if isinstance(exc, http1.UpstreamClosed) and not response.got_bytes:
                self._end()
                # a stale kept-alive connection: served from the start
                server.start_task(cycle, lane.again, head=self.request)
            else:
                failure = exc if isinstance(exc, Exception) else OSError(str(exc))
                server.start_task(cycle, lane.failed(failure), on_end=self._end, head=self.request)
            return
        status = response.status_code
        body = response.received_body() if status not in BODILESS else None
        if body is not None and len(body) <= HEAD_WITH_BODY_MAX:
            answer = lane.answer_head(status, response.raw_headers)
            if answer is not None and server.answer_whole(cycle, answer, body):
                if self._first is not None and response.reusable:  # whole in the read that began it
                    lane.learn(self._first, answer, body)
                response.close()
                self._end()
                return
        relay = lane.relay_opened(UpstreamResponse(response))
        server.start_task(cycle, relay, on_end=self._end, head=self.request)

    def client_left(self) -> None:
        """The client's connection closed before the answer: the upstream sees its request dropped."""
        if self._open:
            self._detach()
            if self._response is not None:
                self._response.close()
            else:
                self._conn.drop()
            self._end()

    def _detach(self) -> None:
        self._open = False
        self._server.inline_done(self)

    def _end(self) -> None:
        ended, self._ended = self._ended, _nothing
        ended()


def _nothing() -> None:
    pass
