"""Run ASGI apps under uvicorn inside the current event loop (several per process).

Used by `hyperswap serve` (one listener per tenant plus admin), by the demo (simulators too) and by
the tests (port 0, read back). Every listener gets the client-side limits of `inbound.py`; the
loop logs failed accepts (out of descriptors) once per interval, not a traceback per attempt; and
listeners stop together (`stop_servers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from proxy.relay.inbound import Guard, InboundLimits, Throttle
from proxy.tasks import poll_until

log = logging.getLogger("hyperswap.servers")

DRAIN_S = 5.0  # what requests in flight get, in all, to finish when the listeners stop
END_S = 2.0  # then, once their connections are closed, to notice it and end
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message for EMFILE, ENFILE, ENOBUFS, ENOMEM


STOP_POLL_S = 0.005  # how often a stopping server looks whether its connections and requests are gone


class _Server(uvicorn.Server):
    """uvicorn.Server that leaves signals alone (the CLI owns them and stops every server at once) and,
    once its 0.1 s tick sees `should_exit`, stops without uvicorn's fixed 0.1 s wait and 0.1 s polls
    for the connections to close: a test's few listeners, stopped that way, took 0.2-0.6 s each time
    (about a third of the suite). The tick itself stays uvicorn's: with it woken at once on exit,
    test_events.py's first-frames test failed every run (stats ids out of order; cause not found)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's order (stop accepting; ask every connection to close once its answer is out; wait
        for the connections, then for the requests) with short polls. No timeout of its own:
        `stop_servers` bounds the drain and sets `force_exit` to end the wait."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        # uvicorn empties these sets from its callbacks and signals neither with an event.
        state = self.server_state
        await poll_until(lambda: not state.connections or self.force_exit, STOP_POLL_S)
        await poll_until(lambda: not state.tasks or self.force_exit, STOP_POLL_S)
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


@dataclass(slots=True)
class RunningServer:
    name: str
    host: str
    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def requests_running(self) -> int:
        return len(self.server.server_state.tasks)

    async def stop(self, drain_s: float = DRAIN_S) -> None:
        await stop_servers([self], drain_s)

    def cut_connections(self) -> None:
        """Close every client connection now (also one uvicorn is already closing, as a websocket
        whose client does not read): relays see their client leave and end quietly."""
        for connection in list(self.server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()

    def cancel_requests(self) -> int:
        tasks = list(self.server.server_state.tasks)
        for task in tasks:
            task.cancel()
        return len(tasks)


async def stop_servers(servers: Sequence[RunningServer], drain_s: float = DRAIN_S) -> None:
    """Stop listeners together, bounded in total. Each stops accepting and closes its idle
    connections at once; the requests in flight get drain_s in all to finish; then their
    connections are closed (clients see the answer cut short; each relay sees its client leave and
    drops its upstream request), and anything still running END_S later is cancelled."""
    running = [s for s in servers if not s.task.done()]
    for s in running:
        s.server.should_exit = True
    pending = await _wait_for_servers(running, drain_s)
    if pending:
        requests = sum(s.requests_running for s in pending)
        log.warning("shutdown: %d request(s) on %s still running after %g s: closing their connections",
                    requests, ", ".join(s.name or str(s.port) for s in pending), drain_s)
        for s in pending:
            s.cut_connections()
        pending = await _wait_for_servers(pending, END_S)
    if pending:
        cancelled = 0
        for s in pending:
            s.server.force_exit = True
            cancelled += s.cancel_requests()
        log.error("shutdown: %d request(s) did not end when their clients were disconnected: cancelled", cancelled)
        pending = await _wait_for_servers(pending, END_S)
    for s in servers:
        if s.task.done() and not s.task.cancelled() and s.task.exception() is not None:
            raise s.task.exception()  # type: ignore[misc]


async def _wait_for_servers(servers: list[RunningServer], timeout_s: float) -> list[RunningServer]:
    """Wait until these servers' tasks end or the time is up; those still running."""
    if servers:
        await asyncio.wait([s.task for s in servers], timeout=timeout_s)
    return [s for s in servers if not s.task.done()]


def settle_heap() -> None:
    """Call once everything is started: what exists now (modules, config, apps) lives as long as the
    process, so the cyclic collector stops rescanning it. Without this, each full collection walked
    that heap on the event loop and stalled every request in flight: 28-37 ms, three times per
    bench/forwarding.py run (proxy c=64 p99 29-41 ms; 15-17 ms with it)."""
    gc.collect()
    gc.freeze()


class _AcceptFailures:
    """The loop's exception handler: asyncio reports each failed accept of a listener out of
    descriptors with a traceback, and retries every second per listener (a proxy at its descriptor
    limit logged 172,031 of them, 75 MB in 35 s). Those become one line per interval with a count;
    everything else goes to the handler that was there before."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.throttle = Throttle()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        held = self.throttle.ready()
        if held is None:
            return
        sock = context.get("socket")
        where = ":".join(str(part) for part in sock.getsockname()[:2]) if sock is not None else "a listener"
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        more = f" ({held} more since the last such line)" if held else ""
        log.error("cannot accept connections on %s: %s%s; new clients wait in the backlog until descriptors "
                  "free up. Fix: raise the open-file limit (ulimit -n, now %d) or lower the connection caps",
                  where, context.get("exception"), more, soft)


def log_accept_failures_once_per_interval(loop: asyncio.AbstractEventLoop) -> None:
    """Install `_AcceptFailures` on this loop (once)."""
    if not isinstance(loop.get_exception_handler(), _AcceptFailures):
        loop.set_exception_handler(_AcceptFailures(loop.get_exception_handler()))


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def start_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, name: str = "",
                       ws_ping_interval: float | None = None, limits: InboundLimits | None = None) -> RunningServer:
    """Bind first (so port 0 can be read back and a busy port fails here), then serve, with the
    client-side limits of `inbound.py` (`limits`, or the defaults)."""
    log_accept_failures_once_per_interval(asyncio.get_running_loop())
    # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
    # IPPROTO_TCP, and without it Nagle + delayed ACK add ~40 ms to small responses.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    guard = Guard(name or f"{host}:{sock.getsockname()[1]}", limits)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", http=guard.protocol,  # type: ignore[arg-type]
        # A ComfyUI socket may idle for hours: no pings of our own, no idle close.
        ws_ping_interval=ws_ping_interval, ws_ping_timeout=None, ws_max_size=64 * 2**20,
        timeout_keep_alive=75,
        # The client address is the socket's: trusting a loopback client's X-Forwarded-For would let it
        # pick the address the engine sees (and uvicorn's middleware costs ~1 % per request).
        proxy_headers=False,
        # Transparent: the upstream's own Server and Date headers are relayed, so add none of ours.
        server_header=False, date_header=False,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{name or port}")

    def started() -> bool:  # uvicorn sets a flag, no event
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError(f"server {name} stopped during start-up")
        return bool(server.started)

    await poll_until(started)
    bound = sock.getsockname()[1]
    return RunningServer(name=name, host=host, port=bound, server=server, task=task)
