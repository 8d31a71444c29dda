"""Progress on the wire (invariant 13, issues 36 and 41): a streamed request that must wait for GPU
memory, or whose model must load, is answered at once and told what happens, in its own protocol,
then the engine's stream follows.

Once the scheduler's plan says the request waits and waiting can succeed (it waits for busy
tenants or behind another waiter, joined a release, or its swap is held: never for a 507, which is
answered at once as before), once its model has been loading for LOAD_GRACE_S (waited for or not:
a cold start, a reload after a release; an engine's quick refusal keeps its status), or once its
app starts, the response starts with the engine's streaming headers and sends short lines: why and
for whom it waits (a held swap as the choice it is), each release, the start of an app, the load (a
figure a second, smoothed between card readings: proxy/relay/load_line.py). They go where the
engine's clients already show a model's thinking:
- Ollama NDJSON (`/api/chat`, `/api/generate`): `message.thinking` / `thinking`, `done: false`;
- OpenAI SSE (`/v1/chat/completions`, `/v1/completions` with `stream: true`): `delta.reasoning_content`
  (llama-swap's sendLoadingState does the same; Open WebUI shows it as a thinking block), on a
  completion's choice beside an empty `text`.
Then the engine's own body follows byte for byte. Anything that goes wrong after that commit (a
507 after all, 503 at the queue timeout, an error status from the engine, the proxy's own 502/504)
is told as a last progress line (`failed: reason (fix: ...)`: Open WebUI drops the error line
below, and shows this one), then ends the stream the way the engine reports a mid-stream error:
Ollama's `{"error": "..."}` line, an OpenAI error event (`data: {"error": {"message", "type",
"param", "code"}}`; the official clients raise both). A request admitted without waiting or
loading is answered exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from proxy.clock import Clock
from proxy.encoding import JSONObject
from proxy.engines.ports import Streamed
from proxy.errors import HyperSwapError
from proxy.handoff.policy import held_swap
from proxy.relay.forward import UpstreamResponse
from proxy.relay.load_line import LoadEstimate, Reading
from proxy.relay.trace import Trace, stamp
from proxy.tasks import sleep_or_wake

log = logging.getLogger("hyperswap.progress")

HEADER = "x-hyperswap-progress"  # on / off: asks for progress lines, or not, whatever the tenant's setting
TICK_S = 0.5  # how often the wait is looked at again when nothing announced a change
LOAD_EVERY_S = 1.0  # how often a load's progress is read from the card
# A load that waited for nothing commits the progress answer this long after it was forwarded: a
# load takes seconds, while an engine's quick refusal (Ollama's 404 for a model it does not have)
# comes within milliseconds and keeps its status, as without the proxy.
LOAD_GRACE_S = 0.3
NDJSON = [(b"content-type", b"application/x-ndjson")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

Result = UpstreamResponse | Response
Waiting = Callable[[], "Mapping[str, object] | None"]  # the scheduler's entry for this request while it waits
Answer = Callable[[Result], Response]  # the answer as it would be without progress (relay, counted)
Finish = Callable[["int | None"], None]  # the request left flight with this status (None: client gone)

_BEHIND = re.compile(r"^queued behind (\S+) \((.+)\)$")


def wanted(setting: str, header: str | None) -> bool:
    """The request's header decides (on / off), else the tenant's `progress` setting."""
    value = (header or "").strip().lower()
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    return setting == "streams"


def wait_line(entry: Mapping[str, object]) -> str:
    """The scheduler's reason for a wait, for the person reading the thinking block."""
    releasing = entry.get("releasing")
    if isinstance(releasing, list | tuple) and releasing:
        return f"releasing {', '.join(map(str, releasing))} to make room"
    reason = str(entry.get("reason") or "waiting for GPU memory")
    held = held_swap(reason)
    if held is not None:
        return hold_line(*held)
    match = _BEHIND.match(reason)
    waiting_for = entry.get("waiting_for")
    if match is not None and isinstance(waiting_for, list | tuple) and len(waiting_for) == 1:
        return f"waiting for {match[1]}: {match[2]}"
    return reason.replace("queued behind", "waiting behind", 1)


def hold_line(tenants: str, hold_s: float) -> str:
    """A held swap (proxy/handoff/hold.py) told as the choice it is, not as a wait for busy work."""
    return (f"keeping {tenants} on the card {hold_s:.1f} s before releasing it: it was just used, and "
            "a request for it that follows goes first (one swap instead of two)")


class Framing:
    """The engine's streaming shape: progress chunks and the mid-stream error."""

    def __init__(self, streamed: Streamed, clock: Clock) -> None:
        self.format = streamed.format
        self.model = streamed.model
        self.clock = clock
        self.created = int(clock.wall())
        self.first = True

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(SSE if self.format.startswith("sse") else NDJSON)

    def progress(self, text: str) -> bytes:
        text = text if text.endswith("\n") else text + "\n"
        fmt = self.format
        if fmt == "ndjson-chat":
            return _line({"model": self.model, "created_at": _rfc3339(self.clock.wall()),
                          "message": {"role": "assistant", "content": "", "thinking": text}, "done": False})
        if fmt == "ndjson-generate":
            return _line({"model": self.model, "created_at": _rfc3339(self.clock.wall()), "response": "", "thinking": text,
                          "done": False})
        if fmt == "sse-chat":
            delta: JSONObject = {"role": "assistant"} if self.first else {}
            delta["reasoning_content"] = text
            self.first = False
            return _event({"id": "chatcmpl-hyperswap", "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        return _event({"id": "cmpl-hyperswap", "object": "text_completion", "created": self.created,
                       "model": self.model,
                       "choices": [{"text": "", "index": 0, "reasoning_content": text, "finish_reason": None}]})

    def error(self, message: str) -> bytes:
        if self.format.startswith("sse"):
            return _event({"error": {"message": message, "type": "api_error", "param": None, "code": None}})
        return _line({"error": message})


def _line(obj: JSONObject) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _event(obj: JSONObject) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def error_message(status: int, body: bytes) -> str:
    """The message of an error answer ({"error": "..."}, OpenAI's {"error": {"message"}}, the
    proxy's own with a "fix"), else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return f"HTTP {status}: {text[:500]}" if text else f"HTTP {status}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str) and err:
            fix = data.get("fix")
            return f"{err} (fix: {fix})" if isinstance(fix, str) and fix else err
    return f"HTTP {status}: {body[:500].decode('utf-8', 'replace')}"


class ProgressResponse(Response):
    """Runs the request's admission and forward (`run`) and answers as soon as it must wait.

    `waiting()`: the scheduler's entry for this request while it waits (`Scheduler.wait_of`);
    `changed`: set whenever a wait may have changed (the decision log's events), so a line goes
    out at once; `answer`: what the listener answers when nothing was committed; `finish`: the
    request leaves flight (every way but through `answer`, which counts its own)."""

    def __init__(self, streamed: Streamed, run: Callable[[], Awaitable[Result]], waiting: Waiting,
                 changed: asyncio.Event, trace: Trace, clock: Clock, answer: Answer, finish: Finish,
                 activity: Callable[[], None] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.body = b""
        self.raw_headers = []
        self._framing = Framing(streamed, clock)
        self._run = run
        self._waiting = waiting
        self._changed = changed
        self._trace = trace
        self._clock = clock
        self._answer = answer
        self._finish = finish
        self._activity = activity
        self._lines: list[str] = []
        self._estimate: LoadEstimate | None = None  # the load under way's smooth figure (None: no load yet)
        self._told_at = 0.0  # when its last line was told
        self._read_at = 0.0  # when the card was last read for it
        self._load_seen: float | None = None  # when a load under way was first seen, before the commit

    async def _figure(self, loading: Callable[[], Awaitable[Reading | None]]) -> Reading | None:
        try:
            return await loading()
        except Exception as exc:  # a card read that fails never breaks the answer
            log.debug("load progress read failed: %r", exc)
            return None

    def _heard(self, line: str) -> None:
        self._lines.append(line)
        self._changed.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._trace.listener = self._heard
        task = asyncio.ensure_future(self._run())
        task.add_done_callback(lambda _t: self._changed.set())
        committed = False
        answered = False  # handed to `answer`, which counts the request's end itself
        said = ""
        status: int | None = None
        try:
            while not task.done():
                self._changed.clear()
                entry = self._waiting()
                planned = entry is not None and bool(entry.get("planned"))
                if not committed and (planned or self._trace.waits or self._load_told()):  # waits, starts or loads
                    committed = True
                    await send({"type": "http.response.start", "status": 200, "headers": self._framing.headers})
                if entry is not None and planned:
                    line = wait_line(entry)
                    if line != said:
                        said = line
                        await self._send_progress(send, line)
                if committed:
                    await self._flush_lines(send)
                    await self._load_figure(send)
                if task.done():
                    break
                if not committed:  # nothing to tell yet: every change of a wait comes as an event
                    await self._until_told()
                    continue
                await sleep_or_wake(self._clock, self._next_look(), self._changed)
            try:
                result: Result = task.result()
            except HyperSwapError as exc:
                result = JSONResponse(exc.body(), status_code=exc.status)
            if not committed:
                self._trace.listener = None
                answered = True
                response = self._answer(result)
                stamp(response.raw_headers, self._trace)
                await response(scope, receive, send)
                return
            await self._flush_lines(send)
            status = await self._engine_stream(send, result)
        finally:
            self._trace.listener = None
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if not answered:
                self._finish(status)  # committed, or the client left before anything was answered

    def _load_told(self) -> bool:
        """A load was forwarded LOAD_GRACE_S ago and its engine has not answered: time to tell it."""
        if self._trace.loading is None:
            self._load_seen = None
            return False
        if self._load_seen is None:
            self._load_seen = self._clock.now()
        return self._clock.now() - self._load_seen >= LOAD_GRACE_S

    async def _until_told(self) -> None:
        """Before the commit: the next event, or the end of a load's grace."""
        if self._load_seen is None:
            await self._changed.wait()
        else:
            await sleep_or_wake(self._clock, max(0.0, self._load_seen + LOAD_GRACE_S - self._clock.now()), self._changed)

    def _next_look(self) -> float:
        """Seconds until the loop looks again with nothing announced: the next load line, else a tick."""
        if self._estimate is None:
            return TICK_S
        return max(0.05, min(TICK_S, self._told_at + LOAD_EVERY_S - self._clock.now()))

    async def _load_figure(self, send: Send) -> None:
        """While a load runs: the card read at once, then a smooth figure every LOAD_EVERY_S
        (proxy/relay/load_line.py), the card read again for each."""
        loading = self._trace.loading
        if loading is None:
            self._estimate = None
            return
        now = self._clock.now()
        if self._estimate is None:
            self._estimate = LoadEstimate()
            self._told_at = now  # "loading X (size)" was just said: the first figure a second from now
        elif now - self._told_at < LOAD_EVERY_S:
            return
        if self._estimate.last is None or now - self._read_at >= LOAD_EVERY_S:
            self._read_at = now
            reading = await self._figure(loading)
            if reading is not None:
                self._estimate.observe(reading)
        if now == self._told_at:
            return
        self._told_at = now
        line = self._estimate.line(now)
        if line:
            await self._send_progress(send, line)

    async def _send_progress(self, send: Send, line: str) -> None:
        await send({"type": "http.response.body", "body": self._framing.progress(line), "more_body": True})

    async def _flush_lines(self, send: Send) -> None:
        while self._lines:
            await self._send_progress(send, self._lines.pop(0))

    async def _engine_stream(self, send: Send, result: Result) -> int:
        """After the commit: the engine's own body as it comes, or its error as the engine ends a
        stream with one. The status the client's answer counts as."""
        if isinstance(result, UpstreamResponse) and result.status_code < 400:
            try:
                async for chunk in result.aiter_raw():
                    if self._activity is not None:
                        self._activity()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (OSError, TimeoutError) as exc:
                log.warning("upstream broke mid-answer to a streamed %s request (%s: %s): ended with an error line",
                            self._framing.model, type(exc).__name__, exc)
                await self._end_with_error(send, f"the engine's answer broke off: {type(exc).__name__}: {exc}")
                return 502
            finally:
                result.close()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return result.status_code
        if isinstance(result, UpstreamResponse):
            try:
                body = await result.aread()
            except HyperSwapError as exc:
                body = json.dumps(exc.body()).encode()
        else:
            body = bytes(result.body)
        await self._end_with_error(send, error_message(result.status_code, body))
        return result.status_code

    async def _end_with_error(self, send: Send, message: str) -> None:
        """The reason as a last progress line, then the engine's error shape: Open WebUI (0.12.4) drops
        an Ollama `{"error"}` line in its conversion to OpenAI chunks and shows only the thinking
        block, where this line lands; the `ollama` and `openai` clients raise the error line as their
        ResponseError / APIError (docs/concepts.md, "When it fails after the first line")."""
        await self._send_progress(send, f"failed: {message}")
        await send({"type": "http.response.body", "body": self._framing.error(message), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
