"""Noticing that an HTTP client went away, with one reader of the request's ASGI `receive()`.

A relay must stop the moment its client leaves: Ollama stops generating only when its request
is cancelled, and a non-streamed generation sends nothing upstream until it is done. A client
leaving shows up in two places, and `ClientLink` covers both:

- while the body is being read, the reader of the body gets `http.disconnect`, which Starlette
  turns into `ClientDisconnect` (and the relay into an aborted upstream request);
- after the body, nobody reads `receive()`, so a watcher does: on `http.disconnect` it cancels
  the task serving the request, which the listener ends quietly (`ClientLink.left` says why).

The watcher never runs while the body is being read (two readers would split the body between
them), and it starts only once a request has lasted `WATCH_AFTER_S`: most requests end sooner,
and a task per request costs ~9 µs against ~120 µs of relay CPU for a small GET. Nothing is armed
per request either: the links of a listener join a `Sweep`, one timer for all of them that ticks
every half WATCH_AFTER_S while requests run and starts the watch of those there a tick before (a
timer per request, armed and cancelled, was ~4 µs, 2.8 % of the relay's busy time in py-spy). The
task to cancel comes from the server (inbound.py's SERVING extension), not from
`asyncio.current_task()` per request; a server without it (tests) is asked at `watch()`.

A request whose framing says it has no body (no Content-Length, or 0, and no Transfer-Encoding) has
its one empty body message made up by the link: the watcher may already have read the server's
(it runs for a bodyless request from WATCH_AFTER_S on, and a start of a stopped app takes longer),
and a body reader must never wait for a message that will not come.

Not seen: a client that pipelines a second request behind a silent first one and then leaves.
uvicorn marks only the queued request as disconnected, so the first one's receive() never says so
(no engine client pipelines; browsers and the ollama/openai clients do not).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope

from proxy.relay.inbound import SERVING

WATCH_AFTER_S = 0.25  # a departed client is noticed within this (plus a loop turn)


def has_body(scope: Scope) -> bool:
    """Whether the request's framing says a body follows (Content-Length not 0, or Transfer-Encoding)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class Sweep:
    """Starts the departure watch of every link that has lasted WATCH_AFTER_S: one timer for all the
    links of a listener, running only while some are open. A link joins the young; each tick (every
    half WATCH_AFTER_S) watches the old ones and makes the young old, so a link is watched after
    between half and all of WATCH_AFTER_S. A link that closes leaves at once: holding it (and the
    request it refers to) until a tick made each request outlive its end, and cost the collector.
    Its timer belongs to the loop of the first link, like the listener it serves."""

    __slots__ = ("_old", "_timer", "_young")

    def __init__(self) -> None:
        self._young: dict[ClientLink, None] = {}
        self._old: dict[ClientLink, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    def join(self, link: ClientLink) -> None:
        if WATCH_AFTER_S <= 0:
            link._due()
            return
        self._young[link] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S / 2, self._tick)

    def leave(self, link: ClientLink) -> None:
        if link in self._young:
            del self._young[link]
        else:
            self._old.pop(link, None)

    def _tick(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # a tick called early (a test) leaves no second timer behind
        due, self._old, self._young = self._old, self._young, {}
        for link in due:
            link._due()
        self._timer = None
        if self._old:
            self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S / 2, self._tick)

    @property
    def listed(self) -> int:
        """Links that joined and neither closed nor were watched yet."""
        return len(self._young) + len(self._old)


class ClientLink:
    """Wraps one request's `receive`; `receive` here is what every body reader must use."""

    __slots__ = (
        "_body_done",
        "_cancelled",
        "_empty_given",
        "_has_body",
        "_receive",
        "_serving",
        "_sweep",
        "_task",
        "_watch_wanted",
        "_watcher",
        "left",
    )

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._receive = receive
        extensions = scope.get("extensions")
        serving = extensions.get(SERVING) if extensions else None
        self._serving: asyncio.Task[Any] | None = serving["task"] if serving else None
        self._task: asyncio.Task[Any] | None = None
        self._sweep: Sweep | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._has_body = has_body(scope)
        self._body_done = not self._has_body
        self._empty_given = False  # a bodyless request's empty body message was handed to a reader
        self._watch_wanted = False
        self._cancelled = False  # this link cancelled the serving task
        self.left = False

    def body(self) -> AsyncIterator[bytes] | bytes:
        """The body as it arrives (see `body_chunks`); b"" when the client framed none, so a
        bodyless GET goes upstream bodyless too, never as an empty chunked body."""
        return body_chunks(self) if self._has_body else b""

    async def receive(self) -> Message:
        if not self._has_body and not self._empty_given:
            self._empty_given = True  # the server's own may be the watcher's already
            return {"type": "http.request", "body": b"", "more_body": False}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.left = True  # the body's reader raises ClientDisconnect; the serving task is not cancelled
            self._body_done = True
        elif not message.get("more_body", False):
            self._body_done = True
            self._maybe_watch()
        return message

    def watch(self, sweep: Sweep) -> None:
        """From now until `close()`, a client that leaves cancels the task serving the request (the
        calling task when the server did not say which)."""
        self._task = self._serving or asyncio.current_task()
        self._sweep = sweep
        sweep.join(self)

    def _due(self) -> None:
        """The request has lasted long enough to be watched (the sweep's tick)."""
        self._watch_wanted = True
        self._maybe_watch()

    def _maybe_watch(self) -> None:
        if self._watch_wanted and self._body_done and self._watcher is None and self._task is not None:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass  # a server may wake receivers without news; only a disconnect matters
        except Exception:  # a server that cannot tell us is no reason to end the request
            return
        self.left = True
        if self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def close(self) -> None:
        """The request is over: stop watching (synchronous, so it also runs in a cancelled task)."""
        self._task = None
        if self._sweep is not None:
            self._sweep.leave(self)
            self._sweep = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def absorb_cancel(self) -> bool:
        """Called on CancelledError: True if it was only this link's (the client left), which then
        ends the request normally; False if someone else cancelled too (shutdown): re-raise."""
        task = asyncio.current_task()
        if not self._cancelled or task is None:
            return False
        return task.uncancel() == 0


async def body_chunks(link: ClientLink) -> AsyncIterator[bytes]:
    """The request body as it arrives; a client leaving mid-body raises ClientDisconnect, so the
    upstream sees an aborted request, never a truncated body that ends cleanly."""
    while True:
        message = await link.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
