"""The client side of every listener: uvicorn's httptools protocol with the limits a server facing
clients needs. uvicorn's httptools protocol has none of them (its h11 one has only
h11_max_incomplete_event_size), and nginx and Envoy ship all of them on by default.

- The request head, checked as it arrives: the request target at most 8 KiB (414, nginx's
  line size), each header line at most 8 KiB, the whole head at most 64 KiB (about Envoy's 60 KiB)
  and 100 headers (Envoy's count) (431). httptools joins a header's pieces by copying, so without
  a cap a 200 MiB header cost 84 s of CPU and 840 MiB; now it costs one read past the limit.
- Header timeout: a head must be whole within 10 s of the connection opening, or of a kept-alive
  connection's next read that leaves a head unfinished (408; a connection that sent nothing is
  just closed). The timer runs only while a head is incomplete, so a long stream, a slow upload
  or a websocket is never cut by it.
- Keep-alive: a connection that answered and waits for its next request rests on its listener's
  one timer (`Guard.rest`), closed once idle for uvicorn's timeout_keep_alive (75 s), as uvicorn
  does with a timer armed per answer and cancelled by the next request.
- Connections: at most 2048 open per listener (websockets and streams count, and are never cut).
  At the cap, a new connection first takes the place of the oldest one that has not sent a whole
  request head yet (it is closed: the way Envoy's overload manager sheds idle connections); only
  when every open connection has sent one is the new one answered 503 and closed. Together with
  the header timeout this bounds what slow clients can hold: without the cap two slowloris clients
  took the proxy to 20,000 descriptors, and without the shedding a slowloris that reconnects as
  soon as it is cut held a listener at its cap (5 of 66 real requests were served, issue 25).
- A refusal is answered, then the connection is closed after reading (and dropping) what the
  client still sends for up to a second, so the client reads the answer rather than a reset
  (nginx's lingering close). At most 64 connections per listener linger; past that, a refused
  connection is reset at once. A head refused while an earlier request on the same connection is
  still being answered gets no answer of its own: the connection ends after that answer.
- Why not uvicorn's limit_concurrency: it counts connections and tasks only once a head is whole
  (so slow heads are never stopped) and answers 503 to requests on connections already accepted.
- `scope["extensions"]["hyperswap.abort"]["abort"](scope)`: ends an answer that cannot be completed (its
  upstream broke) by closing the connection; the client sees the answer cut short and uvicorn
  logs nothing ("ASGI callable returned without completing response" otherwise).
- `scope["extensions"]["hyperswap.serving"]["task"]`: the task serving the request, kept as uvicorn
  starts it, so the departure watch (departure.py) needs no `asyncio.current_task()` per request.
- `scope["extensions"]["hyperswap.head_with_body"]["hold"](scope)`, called just before an answer
  sends its head and then its whole body: the head's write is held and goes out with the body's,
  in one send (socket sends were 29-36 % of the relay's busy time in py-spy, three per relayed
  request where nginx makes two). Anything else asked of the transport first sends the head as it was, so a
  broken promise costs a send, never the head. It says False (nothing held) for a HEAD request,
  whose body uvicorn never writes, or when the request is not the one the connection answers now.

- A GET the app can run itself (`start_inline`, inline.py) is handed to it as soon as its head is
  whole, before uvicorn builds a scope or a request cycle (`lane_cycle`: one with no scope, which
  `start_task` completes if a task takes over); a read that is byte for byte a kept-alive GET the app
  ran so before is handed over unparsed (`start_read`, `learn_read`), with the state the parse would
  have left.

Refusals are logged at most once per 10 s per status, with how many there were.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import httptools
from starlette.types import ASGIApp, Scope
from uvicorn._types import ASGI3Application
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

log = logging.getLogger("hyperswap.inbound")

ABORT = "hyperswap.abort"  # the scope extension that ends an unfinished answer
SERVING = "hyperswap.serving"  # the scope extension that holds the task serving the request
HEAD_WITH_BODY = "hyperswap.head_with_body"  # the scope extension that holds a head for its body
LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class InboundLimits:
    max_target_bytes: int = 8 * 1024
    max_header_line_bytes: int = 8 * 1024  # name + value
    max_head_bytes: int = 64 * 1024  # the request target and every header line together
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections: int = 2048
    linger_s: float = 1.0
    max_lingering: int = 64


class Throttle:
    """Says when something may be logged again (at most once per interval) and how many times it
    was held back meanwhile."""

    def __init__(self, interval_s: float = LOG_EVERY_S, now: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._now = now
        self._next = float("-inf")
        self._held = 0

    def ready(self) -> int | None:
        """The number held back since the last log if it is time to log again, else None."""
        now = self._now()
        if now < self._next:
            self._held += 1
            return None
        held, self._held = self._held, 0
        self._next = now + self.interval_s
        return held


class Guard:
    """One listener's limits and its throttled log of what they refused."""

    def __init__(self, name: str, limits: InboundLimits | None = None) -> None:
        self.name = name
        self.limits = limits or InboundLimits()
        self.lingering = 0
        self._throttles: dict[int, Throttle] = {}
        # Connections that have not sent a whole request head yet, oldest first: shed at the cap.
        self.headless: dict[GuardedHttpProtocol, None] = {}
        self._shed_log = Throttle()
        # Kept-alive connections waiting for their next request, and since when (loop time), oldest
        # first: one timer closes those idle for timeout_keep_alive, not a timer per answer.
        self.resting: dict[GuardedHttpProtocol, float] = {}
        self._rest_timer: asyncio.TimerHandle | None = None

    def rest(self, conn: GuardedHttpProtocol) -> None:
        """A connection answered its last request and waits for the next (uvicorn armed a timer per
        answer here: a TimerHandle made, pushed and cancelled per request)."""
        now = conn.loop.time()
        self.resting[conn] = now
        if self._rest_timer is None:
            self._rest_timer = conn.loop.call_at(now + conn.timeout_keep_alive, self._end_rests, conn.loop)

    def _end_rests(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections that rested timeout_keep_alive (the oldest are first), then wait for the next."""
        self._rest_timer = None
        now = loop.time()
        while self.resting:
            conn, since = next(iter(self.resting.items()))
            due = since + conn.timeout_keep_alive
            if due > now:
                self._rest_timer = loop.call_at(due, self._end_rests, loop)
                return
            del self.resting[conn]
            conn.timeout_keep_alive_handler()

    def shed_oldest_headless(self) -> bool:
        """Close the oldest connection that has not sent a whole request head; False when there is none."""
        while self.headless:
            victim = next(iter(self.headless))
            del self.headless[victim]
            transport = victim.transport
            if transport is None or transport.is_closing():
                continue
            victim.shed()
            held = self._shed_log.ready()
            if held is not None:
                more = f" ({held} more since the last such line)" if held else ""
                log.warning("%s listener at its cap of %d connections: closed the oldest one that had not sent a "
                            "request head%s", self.name, self.limits.max_connections, more)
            return True
        return False

    def refused(self, status: int, reason: str, client: tuple[str, int] | None) -> None:
        held = self._throttles.setdefault(status, Throttle()).ready()
        if held is None:
            return
        who = f"{client[0]}:{client[1]}" if client else "a client"
        more = f" ({held} more {status}s since the last such line)" if held else ""
        log.warning("%s listener: answered %d to %s: %s%s", self.name, status, who, reason, more)

    def protocol(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> GuardedHttpProtocol:
        """uvicorn's `http` protocol factory for this listener."""
        return GuardedHttpProtocol(config, server_state, app_state, _loop, guard=self)


_FIX = {
    408: "send the request head at once; the proxy waits {header_timeout_s:g} s for it",
    414: "shorten the request target (path and query) to at most {max_target_bytes} bytes",
    431: "send fewer or smaller headers: at most {max_headers} headers, {max_header_line_bytes} bytes per "
         "header line and {max_head_bytes} bytes in all",
    503: "retry later, or close idle connections to this listener: it serves at most {max_connections} at once",
}


_FRAMING = frozenset({b"transfer-encoding", b"connection"})  # hop-by-hop: stripped before `answer_whole`


# A whole answer's status line and header lines as uvicorn writes them (no framing, no blank line),
# and its Content-Length (-1: one that is not a number; None: none, so uvicorn would send it chunked).
AnswerHead = tuple[bytes, int | None]


def whole_answer_head(status: int, headers: list[tuple[bytes, bytes]]) -> AnswerHead | None:
    """What `GuardedHttpProtocol.answer_whole` writes before the framing of an answer with this
    status and these (hop-by-hop stripped) headers; None where uvicorn would refuse a header or the
    framing is not its to choose (transfer-encoding or connection left in)."""
    content = [STATUS_LINE[status]]
    length: bytes | None = None
    for name, value in headers:
        if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value) or name in _FRAMING:
            return None
        if name == b"content-length" and length is None:
            length = value
        content += (name, b": ", value, b"\r\n")
    declared = None if length is None else int(length) if length.strip().isdigit() else -1
    return b"".join(content), declared


class Inline(Protocol):
    """An exchange the app runs without a task (inline.py's InlineExchange)."""

    def client_left(self) -> None: ...


# A GET's head as parsed: its target, headers (names lower-cased) and HTTP version.
InlineHead = tuple[bytes, Sequence[tuple[bytes, bytes]], str]
# The app's offer to run a GET's exchange itself (inline.py): given the connection, the target, the
# headers and the HTTP version; the exchange, which took the connection's `lane_cycle`, or None.
StartInline = Callable[["GuardedHttpProtocol", bytes, list[tuple[bytes, bytes]], str], Inline | None]
# The app's offer to run again a read that was, byte for byte, a GET it ran inline: the exchange or None.
StartRead = Callable[["GuardedHttpProtocol", bytes], Inline | None]
# The app told that a read was all of the GET it just took inline (kept alive, HTTP/1.1, no Expect?).
LearnRead = Callable[["GuardedHttpProtocol", bytes, Inline], None]


class _HeadRefused(Exception):
    """Raised in a parser callback to stop httptools; the refusal is recorded on the protocol."""


class GuardedHttpProtocol(HttpToolsProtocol):
    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, guard: Guard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self.limits = guard.limits
        # ASGI extensions are dicts of the extension's own data: a callable each, and the serving task.
        # The task serving the connection's current request (requests on a connection run one at a time).
        self._serving: dict[object, object] = {"task": None}
        self._extensions: dict[str, dict[object, object]] = {
            ABORT: {"abort": self._abort}, SERVING: self._serving, HEAD_WITH_BODY: {"hold": self._hold_head}}
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._in_message = False  # from the first byte of a request to the end of its body
        self._in_head = False  # from the first byte of a request to the end of its headers
        self._begun = 0  # requests begun in the read being parsed
        self._head_read = 0  # bytes of reads that ended inside the current head
        self._head_bytes = 0  # the current head's target and header lines, as parsed
        self._target_bytes = 0
        self._headers = 0
        self._refusal: tuple[int, str] | None = None
        self._closing = False  # refused and answered: what the client still sends is dropped
        # The app's offer to run a passthrough exchange without a task (inline.py), and the one running.
        self._start_inline: StartInline | None = getattr(self.app, "start_inline", None)
        # ... and to run again, unparsed, a read that was such a GET before (byte for byte), and to learn one.
        self._start_read: StartRead | None = getattr(self.app, "start_read", None)
        self._learn_read: LearnRead | None = getattr(self.app, "learn_read", None)
        self._inline: Inline | None = None

    # -- connection ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self.guard.shed_oldest_headless():
            self.transport = transport
            self.flow = FlowControl(transport)
            self.client = transport.get_extra_info("peername")
            self._refuse(503, f"this listener already has {len(self.connections)} connections open")
            return
        super().connection_made(transport)
        self.guard.headless[self] = None
        self._arm_head_timer()  # a connection that never sends a whole head is closed

    def shed(self) -> None:
        """Closed to make room at the cap: it never sent a whole head, so there is no answer to owe."""
        self._disarm_head_timer()
        self._closing = True
        self.transport.abort()  # its descriptor goes now, not after a lingering read

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.headless.pop(self, None)
        self.guard.resting.pop(self, None)
        if self._inline is not None:
            self._inline.client_left()
        self._disarm_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
            self.guard.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, plus the head checks around the parser.
        if self._closing:
            return
        self._unset_keepalive_if_required()
        starts_fresh = not self._in_message
        if starts_fresh and self._known_read(data):
            return
        inline_before = self._inline
        self._begun = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return
        if self._in_head:
            self._head_unfinished(len(data), starts_fresh)
        elif self._inline is not inline_before and self._inline is not None and starts_fresh and self._begun == 1 \
                and not self._in_message and self._learn_read is not None:
            self._learn_read(self, data, self._inline)  # this read was that GET, whole, and nothing else

    def _known_read(self, data: bytes) -> bool:
        """A read that is, byte for byte, a GET the app ran inline before (`learn_read`) and runs again
        now (`start_read`), with no answer owed on the connection: served without a parse. What the
        parse would have left is set here: the head whole, the message complete, the parser between
        messages (only a kept-alive HTTP/1.1 GET with no Expect is learnt)."""
        start = self._start_read
        if start is None or self._inline is not None or self._answer_owed():
            return False
        exchange = start(self, data)
        if exchange is None:
            return False
        self._inline = exchange
        self.guard.headless.pop(self, None)
        self._disarm_head_timer()
        self.expect_100_continue = False
        cycle = self.cycle
        cycle.more_body = False  # on_message_complete's
        cycle.message_event.set()
        return True

    def _answer_owed(self) -> bool:
        """A request on this connection is still being answered (requests on a connection are answered
        in turn: anything else waits for it)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _head_unfinished(self, read: int, starts_fresh: bool) -> None:
        """A read ended inside a head: count it (httptools holds a header's pieces where the
        callbacks cannot see them) and make sure the header timeout runs."""
        if self._begun == 0 or (self._begun == 1 and starts_fresh):
            self._head_read += read  # the whole read belongs to this head
        # else the head began behind another request in this read: counted from the next read
        if self._head_read > self.limits.max_head_bytes:
            self._refuse(431, f"the request head is over {self.limits.max_head_bytes} bytes")
        elif self._head_timer is None:
            self._arm_head_timer()

    # -- parser callbacks ------------------------------------------------------------------------
    # on_message_begin, on_url, on_header and on_message_complete are uvicorn's (0.55) with the head
    # checks folded in, not calls to them: a call per callback was ~3 % of the relay's CPU per small
    # GET. tests/unit/test_uvicorn_hooks.py holds uvicorn's versions to the ones copied here.
    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        self._begun += 1
        self._head_read = self._head_bytes = self._target_bytes = self._headers = 0
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        # uvicorn builds the scope here; it is built once the head is whole, and only for a request a
        # task serves (`_scope`): an inline GET has none

    def on_url(self, url: bytes) -> None:
        self._target_bytes += len(url)
        if self._target_bytes > self.limits.max_target_bytes:
            self._stop(414, f"the request target is over {self.limits.max_target_bytes} bytes")
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        line = len(name) + len(value)
        self._headers += 1
        self._head_bytes += line
        limits = self.limits
        if line > limits.max_header_line_bytes:
            self._stop(431, f"the header {name[:64].decode('latin-1')!r} is over {limits.max_header_line_bytes} bytes")
        if self._headers > limits.max_headers:
            self._stop(431, f"the request has more than {limits.max_headers} headers")
        if self._head_bytes + self._target_bytes > limits.max_head_bytes:
            self._stop(431, f"the request head is over {limits.max_head_bytes} bytes")
        name = name.lower()
        # llhttp keeps trailing OWS, which RFC 9110 5.5 excludes from the value (uvicorn's comment).
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.guard.headless.pop(self, None)
        self._in_head = False
        self._disarm_head_timer()
        if self._start_inline is not None and self._inline is None and self._run_inline():
            return
        self.scope = self._scope(self.headers)  # type: ignore[assignment]  # Starlette's mapping, uvicorn's TypedDict
        super().on_headers_complete()

    def _run_inline(self) -> bool:
        """Whether the app runs this request's exchange itself (inline.py): a GET with no upgrade, on a
        connection with no answer owed, that the app takes. Decided before uvicorn's scope, URL parse
        and cycle are built, which were a fifth of the relay's own Python per small GET."""
        parser = self.parser
        if self._answer_owed() or parser.get_method() != b"GET" or parser.should_upgrade():
            return False
        assert self._start_inline is not None
        self._inline = self._start_inline(self, self.url, self.headers, parser.get_http_version())
        return self._inline is not None

    def lane_cycle(self, http_version: str, *, known: bool = False) -> RequestResponseCycle:
        """The cycle of the request whose head just came, for the app to run inline: uvicorn's, with
        no scope (`start_task` builds it if a task takes over). `known`: a read served unparsed
        (`_known_read`), which is a kept-alive GET with no Expect."""
        keep_alive = known or (http_version != "1.0" and self.parser.should_keep_alive())
        self.cycle = RequestResponseCycle(
            None, self.transport, self.flow, self.logger, self.access_logger,  # type: ignore[arg-type]
            self.access_log, self.server_state.default_headers, asyncio.Event(),
            not known and self.expect_100_continue, keep_alive, self.on_response_complete)
        return self.cycle

    def request_scope(self, method: str, http_version: str, target: bytes, headers: list[tuple[bytes, bytes]]
                      ) -> Scope:
        """The scope uvicorn builds for a request with this head (`on_headers_complete`)."""
        scope = self._scope(headers)
        scope["method"] = method
        if http_version != "1.1":
            scope["http_version"] = http_version
        parsed = httptools.parse_url(target)
        raw_path = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed.query or b""
        return scope

    def _scope(self, headers: list[tuple[bytes, bytes]]) -> Scope:
        """uvicorn's scope as its on_message_begin builds it, with this listener's extensions."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
            "extensions": self._extensions,
        }

    def on_message_complete(self) -> None:
        self._in_message = False
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.more_body = False
        self.cycle.message_event.set()

    # -- keep-alive --------------------------------------------------------------------------------
    def _unset_keepalive_if_required(self) -> None:
        self.guard.resting.pop(self, None)

    def on_response_complete(self) -> None:
        """uvicorn's (the test of uvicorn's hooks checks it does no more than this), with the
        connection resting on its listener's one keep-alive timer instead of a timer of its own."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.guard.resting.pop(self, None)
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.guard.rest(self)

    # -- serving ----------------------------------------------------------------------------------
    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self.start_task(cycle, app)

    def start_task(self, cycle: RequestResponseCycle, app: ASGIApp | ASGI3Application,
                   on_end: Callable[[], None] | None = None, *, head: InlineHead | None = None) -> None:
        """uvicorn's `_start_asgi_task` (the test of uvicorn's hooks checks it does no more than this),
        keeping the task for the departure watch; `on_end` is called when the task ends. `head`: the
        request of an inline exchange's cycle, which has no scope yet (`lane_cycle`)."""
        if head is not None and cycle.scope is None:
            cycle.scope = self.request_scope("GET", head[2], head[0], list(head[1]))
        context = contextvars.Context() if self.config.reset_contextvars else None
        task = self.loop.create_task(cycle.run_asgi(app), context=context)  # type: ignore[arg-type]
        task.add_done_callback(self.tasks.discard)
        if on_end is not None:
            task.add_done_callback(lambda _: on_end())
        self.tasks.add(task)
        self._serving["task"] = task

    def inline_done(self, exchange: Inline) -> None:
        """The inline exchange is over, or handed to a task: the client leaving is no longer its news."""
        if self._inline is exchange:
            self._inline = None

    def answer_whole(self, cycle: RequestResponseCycle, head: AnswerHead, body: bytes) -> bool:
        """uvicorn's two sends of a whole answer (`http.response.start`, then the body with no more to
        come) as one write, with the same head, framing and keep-alive (a GET's: the body is sent).
        `head`: `whole_answer_head`'s. False, with nothing written: not the answer uvicorn would write
        that way (a length that is not the body's, a write that must wait, the cycle not current)."""
        if cycle is not self.cycle or cycle.response_started or cycle.disconnected or self.flow.write_paused:
            return False
        lines, length = head
        if length is None:
            framed = (lines, b"transfer-encoding: chunked\r\n\r\n",
                      *((b"%x\r\n" % len(body), body, b"\r\n0\r\n\r\n") if body else (b"0\r\n\r\n",)))
        elif length == len(body):
            framed = (lines, b"\r\n", body)
        else:
            return False
        cycle.response_started = cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        if cycle.keep_alive:
            self.transport.write(b"".join(framed))
        else:
            self.transport.write(b"".join((framed[0], b"connection: close\r\n", *framed[1:])))
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()
        return True

    def _stop(self, status: int, reason: str) -> None:
        self._refusal = (status, reason)
        raise _HeadRefused(reason)

    # -- header timeout ---------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._closing or self.transport.is_closing():
            return
        if self._answer_owed():
            # A request is being served; a head pipelined behind it waits for it (reading is paused).
            self._arm_head_timer()
        elif not self._in_message:
            self.transport.close()  # connected and said nothing: no request to answer
        else:
            self._refuse(408, f"the request head did not arrive within {self.limits.header_timeout_s:g} s")

    # -- refusing ---------------------------------------------------------------------------------
    def _refuse(self, status: int, reason: str) -> None:
        """Answer `status` with {"error", "fix"}, then close after a lingering read."""
        self._disarm_head_timer()
        self._closing = True
        self.guard.refused(status, reason, self.client)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A head pipelined behind a request still being answered: a refusal written now would land
            # in (or before) that answer. The connection ends after it instead; the rest is dropped.
            cycle.keep_alive = False
            return
        body = json.dumps({"error": reason, "fix": _FIX[status].format(**asdict(self.limits))}).encode()
        self.transport.write(b"".join((
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body)))
        self._linger()

    def _linger(self) -> None:
        transport = self.transport
        if self.guard.lingering >= self.limits.max_lingering or not transport.can_write_eof():
            transport.close()
            return
        self.guard.lingering += 1
        transport.write_eof()  # the answer is all we send; the client's EOF ends the connection
        self._linger_timer = self.loop.call_later(self.limits.linger_s, transport.abort)

    # -- a head sent with its body -----------------------------------------------------------------------
    def _hold_head(self, scope: dict[str, Any]) -> bool:
        cycle = self.cycle
        if cycle is None or cycle.scope is not scope or cycle.response_started or scope["method"] == "HEAD":
            return False
        # The cycle's own transport attribute, swapped for the one answer: the cycle's other writes
        # (every streamed answer) stay as uvicorn makes them, with no stand-in in between.
        cycle.transport = _HeldHead(cycle, cycle.transport)  # type: ignore[assignment]
        return True

    # -- ending an answer that cannot be completed ------------------------------------------------------
    def _abort(self, scope: dict[str, Any]) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.scope is scope and not cycle.response_complete:
            # Disconnected: uvicorn takes the unfinished answer as the client's leaving, not an app error.
            cycle.disconnected = True
            cycle.keep_alive = False
        if not self.transport.is_closing():
            self.transport.close()  # what was sent still goes out; then the client sees the end


class _HeldHead:
    """A cycle's transport from its head to its body: the head's write is kept and goes out with the
    next write (the body, framed by uvicorn) in one. Anything else asked of the transport first sends
    the head as it was, then hands the cycle its transport back."""

    __slots__ = ("cycle", "head", "transport")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        self.cycle = cycle
        self.transport = transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if not self._installed():  # handed back already: a late caller that kept this object
            self.transport.write(data)
        elif self.head is None:
            self.head = data
        else:
            self.cycle.transport = self.transport
            self.transport.write(self.head + data)

    def _installed(self) -> bool:
        current: object = self.cycle.transport  # typed a Transport: this stands in for one (a swapped attribute)
        return current is self

    def __getattr__(self, name: str) -> Any:
        if self._installed():
            self.cycle.transport = self.transport
            if self.head is not None:
                self.transport.write(self.head)
        return getattr(self.transport, name)
