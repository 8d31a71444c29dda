"""A relayed answer's head goes out with its whole small body in one send; a big or streamed body,
a HEAD answer and a broken promise keep their head as its own send (proxy/relay/inbound.py's
head_with_body extension, used by forward.RelayResponse). The listener's protocol is driven with
a transport that records each write: no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from proxy.clock import until_all_wait
from proxy.relay.forward import HEAD_WITH_BODY_MAX, RelayResponse
from proxy.relay.inbound import HEAD_WITH_BODY, Guard

GET = b"GET /x HTTP/1.1\r\nhost: h\r\n\r\n"


class Transport(asyncio.Transport):
    """Records every write, in order, as one entry each."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Upstream:
    """What RelayResponse reads of an upstream answer: whole (`body`) or streamed (`chunks`, fed by the test)."""

    def __init__(self, body: bytes | None, status: int = 200) -> None:
        self.status_code = status
        self.body = body
        self.raw_headers = [(b"content-length", b"%d" % len(body))] if body is not None else []
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

    def received_body(self) -> bytes | None:
        return self.body

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (chunk := await self.chunks.get()) is not None:
            yield chunk

    def close(self) -> None:
        pass


def serve(app: Any, request: bytes = GET) -> Transport:
    """A listener's protocol on a recording transport, fed `request`."""
    config = Config(app=app, log_config=None, server_header=False, date_header=False, lifespan="off")
    protocol = Guard("test").protocol(config, ServerState(), {}, asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    return transport


def relaying(upstream: Upstream) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await RelayResponse(upstream, on_close=lambda: None)(scope, receive, send)  # type: ignore[arg-type]
    return app


async def test_a_small_whole_answer_goes_out_with_its_head_in_one_send() -> None:
    transport = serve(relaying(Upstream(b"ok")))
    await until_all_wait()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"], transport.writes


async def test_an_empty_answer_goes_out_in_one_send_too() -> None:
    transport = serve(relaying(Upstream(b"", status=204)))
    await until_all_wait()
    assert transport.writes == [b"HTTP/1.1 204 No Content\r\n\r\n"], transport.writes


async def test_a_big_whole_answer_keeps_its_head_as_its_own_send() -> None:
    body = b"x" * (HEAD_WITH_BODY_MAX + 1)
    transport = serve(relaying(Upstream(body)))
    await until_all_wait()
    assert transport.writes[1:] == [body] and transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n"), \
        "a big body is not copied to join its head"


async def test_a_streamed_answer_sends_its_head_before_any_body_arrives() -> None:
    upstream = Upstream(None)
    transport = serve(relaying(upstream))
    await until_all_wait()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"], \
        "the head of a stream must not wait for its first chunk"
    upstream.chunks.put_nowait(b"line\n")
    upstream.chunks.put_nowait(None)
    await until_all_wait()
    assert transport.writes[1:] == [b"5\r\nline\n\r\n", b"0\r\n\r\n"], transport.writes


async def test_a_head_request_is_answered_with_its_head_alone() -> None:
    transport = serve(relaying(Upstream(b"ok")), b"HEAD /x HTTP/1.1\r\nhost: h\r\n\r\n")
    await until_all_wait()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"], \
        "uvicorn writes no body for HEAD: a held head would never go out"


async def test_a_held_head_still_goes_out_when_no_body_follows() -> None:
    held: list[bool] = []

    async def breaks_its_promise(scope: dict[str, Any], receive: Any, send: Any) -> None:
        held.append(scope["extensions"][HEAD_WITH_BODY]["hold"](scope))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        raise RuntimeError("the body never came")

    transport = serve(breaks_its_promise)
    await until_all_wait()
    assert held == [True]
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"] and transport.closed, \
        "the client sees the head, then the connection end, as without the hold"


async def test_only_the_request_being_answered_can_hold_its_head() -> None:
    answers: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        stale = {**scope}  # not the scope of the cycle the connection answers
        answers.append(scope["extensions"][HEAD_WITH_BODY]["hold"](stale))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = serve(app)
    await until_all_wait()
    assert answers == [False]
    assert len(transport.writes) == 2, "nothing was held: head and body as two sends"
