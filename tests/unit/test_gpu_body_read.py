"""A GPU request's body is read straight from `receive` (not through Starlette's stream): whole when it
fits the replay limit, else every byte still reaches the engine in order, once; a client that leaves
mid-body is a ClientDisconnect, as with Starlette's reader."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from proxy.relay.listener import _read_up_to


def request(messages: list[dict[str, Any]], length: int | None = None) -> Request:
    pending = list(messages)

    async def receive() -> dict[str, Any]:
        return pending.pop(0)

    headers = [(b"host", b"h")] + ([(b"content-length", b"%d" % length)] if length is not None else [])
    return Request({"type": "http", "method": "POST", "path": "/api/generate", "headers": headers}, receive)


def part(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def drained(chunks: AsyncIterator[bytes] | None) -> bytes:
    assert chunks is not None
    return b"".join([c async for c in chunks])


@pytest.mark.parametrize("messages", [
    [part(b'{"model": "m"}', False)],
    [part(b'{"mod', True), part(b"", True), part(b'el": "m"}', False)],
    [part(b"", False)],
])
async def test_a_body_that_fits_is_read_whole(messages: list[dict[str, Any]]) -> None:
    body, rest = await _read_up_to(request(messages), 1024)
    assert rest is None
    assert body == b"".join(m["body"] for m in messages)


@pytest.mark.parametrize("messages", [
    [part(b"a" * 6, True), part(b"b" * 6, True), part(b"c" * 6, False)],
    [part(b"a" * 6, True), part(b"b" * 6, False)],
    [part(b"a" * 20, False)],
])
async def test_a_body_over_the_limit_reaches_the_engine_whole_in_order(messages: list[dict[str, Any]]) -> None:
    body, rest = await _read_up_to(request(messages), 10)
    assert body == b""
    assert await drained(rest) == b"".join(m["body"] for m in messages)


async def test_a_declared_length_over_the_limit_is_not_read_first() -> None:
    messages = [part(b"a" * 6, True), part(b"b" * 6, False)]
    body, rest = await _read_up_to(request(messages, length=12), 10)
    assert body == b"" and await drained(rest) == b"a" * 6 + b"b" * 6


@pytest.mark.parametrize("limit", [1024, 4])
async def test_a_client_that_leaves_mid_body_is_a_disconnect(limit: int) -> None:
    messages = [part(b"abcdef", True), {"type": "http.disconnect"}]
    with pytest.raises(ClientDisconnect):
        _, rest = await _read_up_to(request(messages), limit)
        await drained(rest)
