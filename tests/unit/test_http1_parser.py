"""The relay client's answer parsing, fed packet by packet through a mock transport (the way uvicorn
tests its protocols): every answer is fed whole, split at every byte boundary, and byte by byte,
and must read the same every time."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from proxy.relay.http1 import Pool, Response, UpstreamProtocolError, _Connection


class MockTransport:
    """Just what a connection asks of its transport."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def splits(raw: bytes) -> Iterator[tuple[str, list[bytes]]]:
    yield "whole", [raw]
    for i in range(1, len(raw)):
        yield f"split at {i}", [raw[:i], raw[i:]]
    yield "byte by byte", [raw[i:i + 1] for i in range(len(raw))]


def awaited(*, head_only: bool = False) -> tuple[Response, _Connection]:
    """A response on a pooled connection, before the upstream sent anything."""
    pool = Pool("http://upstream.invalid:80")
    conn = _Connection(pool, asyncio.get_running_loop())
    conn.connection_made(MockTransport())  # type: ignore[arg-type]
    response = conn.response = Response(conn, head_only=head_only)
    return response, conn


def fed(packets: list[bytes], *, head_only: bool = False) -> tuple[Response, _Connection]:
    """A response on a pooled connection after the upstream sent these packets."""
    response, conn = awaited(head_only=head_only)
    for packet in packets:
        conn.data_received(packet)
    return response, conn


CHUNKED_WITH_TRAILERS = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nTrailer: Set-Cookie\r\n\r\n"
    b"3\r\none\r\n3\r\ntwo\r\n0\r\nSet-Cookie: session=stolen\r\nX-Checksum: 1\r\n\r\n")


async def test_trailers_never_become_headers_however_the_packets_fall() -> None:
    for how, packets in splits(CHUNKED_WITH_TRAILERS):
        response, _ = fed(packets)
        assert response.raw_headers == [(b"content-type", b"text/plain"), (b"transfer-encoding", b"chunked"),
                                         (b"trailer", b"Set-Cookie")], f"{how}: a trailer was added to the headers"
        assert response.received_body() == b"onetwo", how
        assert response._complete and response._keep_alive, f"{how}: the answer must end and keep its connection"


async def test_headers_after_an_interim_answer_are_the_final_answers_only() -> None:
    raw = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    for how, packets in splits(raw):
        response, _ = fed(packets)
        assert (response.status_code, response.raw_headers) == (200, [(b"content-length", b"2")]), how
        assert response.received_body() == b"ok", how


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x02hi",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x8b\x08\x00\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nConnection: close\r\n\r\n\x1f\x8b\x08\x00",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
], ids=["101-to-a-plain-request", "gzip-then-chunked", "gzip-alone", "codings-over-two-headers"])
async def test_an_answer_the_relay_cannot_pass_on_is_a_protocol_error(raw: bytes) -> None:
    for how, packets in splits(raw):
        response, conn = fed(packets)
        assert isinstance(response._error, UpstreamProtocolError), f"{how}: got {response._error!r}"
        assert response.status_code == 0 and response.received_body() is None, how
        response.close()
        assert conn.transport is not None and conn.transport.is_closing(), f"{how}: its connection must be dropped"


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_with_a_content_length_ends_at_its_head(status: int) -> None:
    raw = b"HTTP/1.1 %d X\r\nContent-Length: 5\r\nETag: \"e\"\r\n\r\n" % status
    for how, packets in splits(raw):
        response, _ = fed(packets)
        assert response.status_code == status and response.received_body() == b"", how
        assert response._keep_alive, f"{how}: the connection stays usable"


SMALL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_an_answer_whole_in_one_read_is_handed_to_its_head_callback_in_that_read() -> None:
    # the inline exchange's answer: handed over at once, not a loop turn later, when it is all there
    response, conn = awaited()
    seen: list[bytes | None] = []
    response.on_head(lambda head: seen.append(response.received_body()))
    conn.data_received(SMALL)
    assert seen == [b"ok"]


async def test_an_answer_still_arriving_is_handed_over_on_the_next_loop_turn_however_the_packets_fall() -> None:
    for name, packets in splits(SMALL):
        response, conn = awaited()
        calls: list[asyncio.Future[None]] = []
        response.on_head(calls.append)
        for packet in packets:
            conn.data_received(packet)
        await asyncio.sleep(0)
        assert len(calls) == 1 and calls[0].done() and calls[0].exception() is None, name
        assert response.status_code == 200 and response.received_body() == b"ok", name


async def test_a_connection_closed_before_the_answer_fails_its_head_callback_at_once() -> None:
    response, conn = awaited()
    calls: list[asyncio.Future[None]] = []
    response.on_head(calls.append)
    conn.connection_lost(None)
    assert len(calls) == 1 and calls[0].exception() is not None and not response.got_bytes


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",  # whole: the connection goes back to the pool
    b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nok",  # cut short: the connection is dropped
], ids=["released", "dropped"])
async def test_a_closed_answer_is_freed_as_soon_as_nothing_refers_to_it_not_by_the_collector(answer: bytes) -> None:
    # Each answer is a parser and its callbacks: left in a reference cycle, every relayed request
    # would be garbage only the cyclic collector frees, and its collections run on the event loop.
    gc.collect()
    gc.disable()
    try:
        response, conn = fed([answer])
        freed = weakref.ref(response)
        response.close()
        del response
        assert freed() is None, f"held by {[type(r).__name__ for r in gc.get_referrers(freed())]}"
        assert conn.response is None
    finally:
        gc.enable()
