"""Stopping the proxy under load: every listener drains at once, bounded in total, then what is
left is ended quietly (clients see their answers cut, upstream requests are dropped, one log line).
100 streams on loopback; the waits only turn a hang into a failure, nothing here measures time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from proxy.engines.loading import registry_from_dict
from proxy.service import Proxy
from proxy.sim.gpu import SimulatedGpu
from proxy.tasks import poll_until

SAFETY_S = 15.0
STREAMS = 100
FIRST = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ntoken\n\r\n"
LAST = b"5\r\ndone\n\r\n0\r\n\r\n"


class Engine:
    """Answers every GET with a chunked stream: the first line at once, the end when `finish` is set."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.open = 0  # connections from the proxy still open
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(FIRST)
            await writer.drain()
            finishing = asyncio.ensure_future(self.finish.wait())
            gone = asyncio.ensure_future(reader.read())  # b"" once the proxy drops the request
            await asyncio.wait([finishing, gone], return_when=asyncio.FIRST_COMPLETED)
            finishing.cancel()
            gone.cancel()
            if self.finish.is_set() and not reader.at_eof():
                writer.write(LAST)
                await writer.drain()
                await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def proxy_in_front(drain_s: float) -> AsyncIterator[tuple[Proxy, Engine]]:
    engine = Engine()
    engine.server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    # The shipped listen addresses stay in the config; start() binds port 0 in their place.
    registry = registry_from_dict({"tenants": {"ollama": {"upstream": engine.url}, "comfyui": {"upstream": engine.url}}})
    proxy = Proxy(registry, SimulatedGpu(), watchdog_enabled=False, extension_factories=[], drain_s=drain_s)
    await proxy.start({"ollama": 0, "comfyui": 0, "admin": 0})
    try:
        yield proxy, engine
    finally:
        engine.finish.set()
        await proxy.stop()
        engine.server.close()


async def open_streams(proxy: Proxy) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """STREAMS streams, half through each tenant listener, each with its first line read."""
    async def one(i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        server = proxy.servers["ollama" if i % 2 else "comfyui"]
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /stream/%d HTTP/1.1\r\nHost: localhost\r\n\r\n" % i)
        await reader.readuntil(b"token\n\r\n")
        return reader, writer
    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(STREAMS))), SAFETY_S)


async def refuses(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        return True  # reset: the listener closed with this connection still in its backlog
    writer.close()
    return False


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def asgi_tasks_left() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if "run_asgi" in repr(t.get_coro())]


async def test_listeners_drain_together_and_streams_that_finish_in_time_end_whole() -> None:
    async with proxy_in_front(drain_s=SAFETY_S) as (proxy, engine):
        streams = await open_streams(proxy)
        ports = [s.port for s in proxy.servers.values()]
        stopping = asyncio.ensure_future(proxy.stop())

        async def all_refuse() -> bool:
            return all([await refuses(port) for port in ports])
        await asyncio.wait_for(poll_until(all_refuse, 0.01), SAFETY_S)
        # One after another, a listener stops accepting only once the one before it is done (drained, or
        # given up on after its own 5 s); together, every tenant listener is still draining its streams.
        tenants = [proxy.servers[name] for name in ("ollama", "comfyui")]
        assert not any(server.task.done() for server in tenants), "a listener stopped before the others began"
        assert not stopping.done() and engine.open == STREAMS, "the streams in flight must still be draining"
        engine.finish.set()
        await asyncio.wait_for(stopping, SAFETY_S)
        tails = [await asyncio.wait_for(reader.read(), SAFETY_S) for reader, _ in streams]
        for _, writer in streams:
            writer.close()
    assert all(tail.endswith(LAST) for tail in tails), "a stream that ends within the drain reaches its client whole"


async def test_streams_past_the_drain_are_cut_quietly_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    server_log = _Records()
    async with proxy_in_front(drain_s=0.2) as (proxy, engine):
        streams = await open_streams(proxy)
        logging.getLogger("uvicorn.error").addHandler(server_log)
        try:
            with caplog.at_level(logging.DEBUG, logger="hyperswap"):
                await asyncio.wait_for(proxy.stop(), SAFETY_S)
                left = asgi_tasks_left()
        finally:
            logging.getLogger("uvicorn.error").removeHandler(server_log)
        tails: list[bytes] = []
        for reader, writer in streams:
            with contextlib.suppress(ConnectionError):
                tails.append(await asyncio.wait_for(reader.read(), SAFETY_S))
            writer.close()

        await asyncio.wait_for(poll_until(lambda: not engine.open, 0.01), SAFETY_S)  # upstream requests dropped
    assert left == [], f"{len(left)} requests still running after stop()"
    assert not any(tail.endswith(b"0\r\n\r\n") for tail in tails), "a cut stream must not look whole"
    assert [r.getMessage() for r in server_log.records if r.levelno >= logging.WARNING] == [], \
        "no server errors (a CancelledError traceback per stream before)"
    ours = [r for r in caplog.records if r.name.startswith("hyperswap") and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and f"{STREAMS} request(s)" in ours[0].getMessage(), [r.getMessage() for r in ours]
    assert all(r.exc_info is None for r in caplog.records), "no tracebacks"
