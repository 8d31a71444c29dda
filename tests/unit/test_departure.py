"""ClientLink: one reader of receive(); the watch starts only after the body (and, through the listener's
Sweep, only once a request has lasted a tick) and cancels only the task serving the request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from proxy.clock import until_all_wait
from proxy.relay import departure
from proxy.relay.departure import ClientLink, Sweep, body_chunks
from proxy.relay.inbound import SERVING

WITH_BODY = {"type": "http", "headers": [(b"content-length", b"8")]}
NO_BODY = {"type": "http", "headers": []}


class FakeReceive:
    """An ASGI receive fed by the test; counts who asked."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return await self.queue.get()


@pytest.fixture(autouse=True)
def watch_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 0.0)


async def serve_until_cancelled(link: ClientLink, started: asyncio.Event) -> str:
    link.watch(Sweep())
    started.set()
    try:
        await asyncio.sleep(60)  # hangs: a request being served until it is cancelled (a fake, no threshold)
        return "not cancelled"
    except asyncio.CancelledError:
        if link.absorb_cancel():
            return "client left"
        raise
    finally:
        link.close()


async def serving(scope: dict[str, Any]) -> tuple[FakeReceive, ClientLink, asyncio.Task[str]]:
    """A request being served (watched) until its link cancels it."""
    receive = FakeReceive()
    link = ClientLink(scope, receive)
    started = asyncio.Event()
    task = asyncio.create_task(serve_until_cancelled(link, started))
    await started.wait()
    return receive, link, task


async def test_watch_never_takes_a_body_part_the_body_reader_has_not_read_yet() -> None:
    receive, link, task = await serving(WITH_BODY)
    await until_all_wait()
    # The body reader is busy (an upstream applying back-pressure): the part must wait for it.
    receive.queue.put_nowait({"type": "http.request", "body": b"part", "more_body": True})
    await until_all_wait()
    assert receive.queue.qsize() == 1 and receive.calls == 0, "only the body reader may read while the body is unread"
    assert await link.receive() == {"type": "http.request", "body": b"part", "more_body": True}
    receive.queue.put_nowait({"type": "http.request", "body": b"last", "more_body": False})
    assert (await link.receive())["body"] == b"last"
    await until_all_wait()
    assert receive.calls == 3, "after the body, the watch reads receive()"
    receive.queue.put_nowait({"type": "http.disconnect"})
    assert await asyncio.wait_for(task, 5) == "client left"
    assert link.left


async def test_a_request_without_body_is_watched_from_the_start() -> None:
    receive, _link, task = await serving(NO_BODY)
    receive.queue.put_nowait({"type": "http.disconnect"})
    assert await asyncio.wait_for(task, 5) == "client left"


async def test_a_request_that_ends_before_the_delay_never_starts_a_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 60.0)
    receive = FakeReceive()
    link = ClientLink(NO_BODY, receive)
    link.watch(Sweep())
    await until_all_wait()
    link.close()
    await until_all_wait()
    assert receive.calls == 0


async def test_shutdown_cancelling_too_is_not_absorbed() -> None:
    receive, _link, task = await serving(NO_BODY)
    await until_all_wait()
    receive.queue.put_nowait({"type": "http.disconnect"})
    task.cancel()  # the server stops at the same moment
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_client_leaving_mid_body_raises_for_the_reader_and_cancels_nothing() -> None:
    receive, link, task = await serving(WITH_BODY)
    receive.queue.put_nowait({"type": "http.request", "body": b"half", "more_body": True})
    receive.queue.put_nowait({"type": "http.disconnect"})
    parts = []
    with pytest.raises(ClientDisconnect):
        async for part in body_chunks(link):
            parts.append(part)
    assert parts == [b"half"] and link.left
    await until_all_wait()
    assert not task.done(), "the body's reader reports it; the serving task ends through that error"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_sweep_watches_a_link_only_once_it_has_lasted_a_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 60.0)  # the sweep's own timer never fires here: ticks by hand
    receive = FakeReceive()
    link = ClientLink(NO_BODY, receive)
    sweep = Sweep()
    link.watch(sweep)
    sweep._tick()  # the link joined after the last tick: it may have lasted no time at all
    await until_all_wait()
    assert receive.calls == 0, "a request younger than a tick is not watched"
    sweep._tick()
    await until_all_wait()
    assert receive.calls == 1, "a request there a tick before is watched"
    assert sweep.listed == 0
    link.close()


async def test_a_link_that_closes_leaves_the_sweep_and_is_never_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(departure, "WATCH_AFTER_S", 60.0)
    receive = FakeReceive()
    sweep = Sweep()
    links = [ClientLink(NO_BODY, receive) for _ in range(3)]
    for link in links:
        link.watch(sweep)
    sweep._tick()
    links[0].close()  # an old one
    links[2].close()
    assert sweep.listed == 1, "a closed request is not held until a tick"
    sweep._tick()
    await until_all_wait()
    assert receive.calls == 1, "only the open one is watched"
    links[1].close()
    sweep._tick()
    assert sweep._timer is None, "no timer runs once no request is listed"


async def test_the_task_the_server_names_is_the_one_cancelled() -> None:
    receive = FakeReceive()
    serving = asyncio.create_task(asyncio.Event().wait())  # the server's task for the request, until cancelled
    scope = {**NO_BODY, "extensions": {SERVING: {"task": serving}}}
    link = ClientLink(scope, receive)
    link.watch(Sweep())  # from this test's task: the server's extension says which task to cancel
    receive.queue.put_nowait({"type": "http.disconnect"})
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(serving, 5)
    assert link.left
    link.close()
