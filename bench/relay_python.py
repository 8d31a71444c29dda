"""The relay's own Python per inline GET: the fixed cost under the socket calls.

Run: python bench/relay_python.py [--requests N] [--runs N]
One process, no sockets: a tenant listener's real protocol (inbound.py), its app (listener.py), the
inline lane (inline.py) and the upstream pool (http1.py), with fake transports that keep what is
written. Each request is fed to the protocol as one read and its answer to the pooled connection as
one read, so the figure is the Python of one exchange with the socket calls and the event loop left
out (`bench/forwarding.py` measures the whole, side by side with nginx). Another connection is kept
counted in flight, as under load. Prints the median and minimum over the runs (microseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from proxy.config.schema import Tenant  # noqa: E402
from proxy.handoff.inflight import InFlight  # noqa: E402
from proxy.relay import http1  # noqa: E402
from proxy.relay.forward import Forwarder  # noqa: E402
from proxy.relay.inbound import Guard  # noqa: E402
from proxy.relay.listener import TenantApp  # noqa: E402

REQUEST = b"GET /small HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n"
ANSWER = (b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 16:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 2\r\n"
          b"content-type: text/plain; charset=utf-8\r\n\r\nok")


class FakeTransport:
    """What the protocol and the pool ask of a transport; writes are kept (the last few)."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.written: list[bytes] = []
        self.sock = sock
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if len(self.written) > 64:
            del self.written[:32]

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"socket": self.sock, "peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True


async def measure(requests: int, runs: int) -> list[float]:
    loop = asyncio.get_running_loop()
    tenant = Tenant(name="bench", engine="ollama", upstream="http://127.0.0.1:9")
    forwarder, inflight = Forwarder(), InFlight()
    app = TenantApp(tenant, forwarder, inflight)
    guard = Guard("bench")
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            http=guard.protocol,  # type: ignore[arg-type]
                            timeout_keep_alive=75, proxy_headers=False, server_header=False, date_header=False)
    config.load()
    inflight.connection_opened(tenant.name)  # another connection in flight: as under load
    client = FakeTransport()
    proto = guard.protocol(config, ServerState(), {})
    proto.connection_made(client)  # type: ignore[arg-type]
    # One pooled upstream connection, put in the pool as a dialled one would be (the pool has no
    # public way to adopt a connection: this is a bench of its insides).
    pool = forwarder._tenant_pools(tenant).relay
    ours, _theirs = socket.socketpair()
    conn = http1.Connection(pool, loop)
    conn.counted = True
    pool._open += 1
    upstream = FakeTransport(ours)
    conn.connection_made(upstream)  # type: ignore[arg-type]
    conn.idle_since = loop.time()
    pool._idle.append(conn)

    def one() -> None:
        proto.data_received(REQUEST)
        conn.data_received(ANSWER)

    for _ in range(2000):  # warm: the lane learns the request and the answer
        one()
    if not (client.written and client.written[-1].endswith(b"ok") and upstream.written[-1].startswith(b"GET /small")):
        raise SystemExit(f"the exchange did not run inline: {client.written[-1:]!r} {upstream.written[-1:]!r}")
    out: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(requests):
            one()
        out.append((time.perf_counter() - start) / requests * 1e6)
        await asyncio.sleep(0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="exchanges per run")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    runs = asyncio.run(measure(args.requests, args.runs))
    print(f"relay Python per inline GET: median {statistics.median(runs):.2f} us, min {min(runs):.2f} us "
          f"({args.runs} runs of {args.requests:,})")


if __name__ == "__main__":
    main()
