"""Forwarding overhead: direct to a minimal upstream vs through a HyperSwap tenant listener.

Not a test: run `python bench/forwarding.py` (about a minute). The upstream and the proxy each run in
their own process (so the proxy's RSS can be read with psutil); direct and proxied runs are
interleaved in one session so drift hits both equally. The small-request rows also go through a
"byte splice" (copies bytes both ways, no HTTP): the floor any Python relay on the same event loop
and the same cores can reach. Prints a table and writes bench/results/forwarding.json.

Side by side, in the same interleaved rounds of small GETs: `--nginx` adds nginx as a reverse proxy
(one worker, keep-alive to the upstream; Debian's `nginx` package), `--compare DIR` adds the proxy
of another checkout (an A/B against an earlier commit: `git worktree add DIR COMMIT`). `--small`
runs only the small-GET rows (for repeated A/B runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import httpx
import psutil

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.types import ASGIApp

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "forwarding.json"
CHUNKS = 50
CHUNK_GAP_S = 0.002
UPLOAD_BYTES = 2**30


# --------------------------------------------------------------------------------------------
# the two server processes


def upstream_app() -> Starlette:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def small(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(CHUNKS):
                # CLOCK_MONOTONIC is system-wide on Linux: the client can subtract it.
                yield f'{{"sent_ns": {time.monotonic_ns()}}}\n'.encode()
                await asyncio.sleep(CHUNK_GAP_S)
        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    async def upload(request: Request) -> JSONResponse:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
        return JSONResponse({"received": n})

    return Starlette(routes=[Route("/small", small), Route("/api/generate", stream, methods=["POST"]),
                             Route("/api/blobs/{d}", upload, methods=["POST"])])


class _SpliceUp(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)


class _SpliceDown(asyncio.Protocol):
    """The floor: copy bytes both ways over one upstream connection per client connection, no HTTP
    at all. Nothing that parses HTTP in Python on this loop can add less than this."""

    upstream: tuple[str, int] = ("127.0.0.1", 0)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.down = cast(asyncio.Transport, transport)
        self.up: asyncio.Transport | None = None
        self.early: list[bytes] = []
        self.connecting = asyncio.ensure_future(self._connect())  # held: the loop keeps only a weak reference

    async def _connect(self) -> None:
        up, _ = await asyncio.get_running_loop().create_connection(lambda: _SpliceUp(self.down), *self.upstream)
        self.up = up
        for data in self.early:
            up.write(data)

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.early.append(data)
        else:
            self.up.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


class _LeanUp(asyncio.Protocol):
    """One kept-alive connection of `_LeanDown`'s pool: parses an answer, hands it back whole."""

    def __init__(self, pool: list[_LeanUp]) -> None:
        import httptools
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.down: _LeanDown | None = None
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"connection", b"keep-alive", b"transfer-encoding"):
            self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        down, self.down = self.down, None
        body = b"".join(self.body)
        head = b"HTTP/1.1 %d OK\r\n%scontent-length: %d\r\n\r\n" % (
            self.parser.get_status_code(), b"".join(h for h in self.headers if not h.lower().startswith(b"content-length")),
            len(body))
        self.headers, self.body = [], []
        self.pool.append(self)
        if down is not None:
            down.transport.write(head + body)  # type: ignore[attr-defined]


class _LeanDown(asyncio.Protocol):
    """A lean HTTP/1.1 relay with no ASGI: the client's connection parses a request (httptools) and
    its protocol runs the exchange itself on a pooled upstream connection, callbacks only (no task,
    no scope, no response object), headers rewritten as the proxy does (Host, X-Forwarded-*). Not
    the product: a GET-only floor for the protocol-level design (`--lean`)."""

    upstream: tuple[str, int] = ("127.0.0.1", 0)
    pool: ClassVar[list[_LeanUp]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import httptools
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"host":
            self.host = value
        else:
            self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_message_complete(self) -> None:
        host, port = self.upstream
        head = b"%s %s HTTP/1.1\r\nhost: %s:%d\r\n%sx-forwarded-for: 127.0.0.1\r\nx-forwarded-proto: http\r\n" \
               b"x-forwarded-host: %s\r\n\r\n" % (self.parser.get_method(), self.url, host.encode(), port,
                                                    b"".join(self.headers), self.host)
        self.url, self.headers = b"", []
        if self.pool:
            up = self.pool.pop()
            up.down = self
            up.transport.write(head)  # type: ignore[attr-defined]
        else:
            self.dialling = asyncio.ensure_future(self._dial(head))  # held: the loop keeps only a weak reference

    async def _dial(self, head: bytes) -> None:
        _, up = await asyncio.get_running_loop().create_connection(lambda: _LeanUp(self.pool), *self.upstream)
        up.down = self
        up.transport.write(head)  # type: ignore[attr-defined]


async def serve(role: str, upstream: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    from proxy.relay.servers import settle_heap, start_server

    if role in ("splice", "lean"):
        assert upstream is not None
        host, port = upstream.removeprefix("http://").split(":")
        _SpliceDown.upstream = _LeanDown.upstream = (host, int(port))
        factory = _SpliceDown if role == "splice" else _LeanDown
        listening = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        print(listening.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()
    app: ASGIApp
    if role == "upstream":
        app = upstream_app()
    else:
        from proxy.config.schema import Tenant
        from proxy.handoff.inflight import InFlight
        from proxy.relay.forward import Forwarder
        from proxy.relay.listener import TenantApp

        tenant = Tenant(name="bench", engine="ollama", upstream=upstream)
        app = TenantApp(tenant, Forwarder(), InFlight())
    server = await start_server(app, name=role)
    settle_heap()  # as `hyperswap serve` does once started
    print(server.port, flush=True)
    await asyncio.Event().wait()


def spawn(role: str, upstream: str | None, loop: str = "asyncio",
          root: Path = ROOT) -> tuple[subprocess.Popen[str], str]:
    """One server process; `root`: the checkout whose bench script (and so whose proxy) serves it."""
    args = [sys.executable, str(root / "bench" / "forwarding.py"), "--serve", role, "--loop", loop] \
        + (["--upstream", upstream] if upstream else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=root)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


NGINX_CONF = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream engine {{ server {upstream}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def spawn_nginx(upstream: str, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    """nginx as a keep-alive reverse proxy with one worker (the proxy is one event loop too); its
    CPU is the master's and the worker's together."""
    binary = nginx_binary()
    if binary is None:
        raise SystemExit("--nginx: no nginx binary found (Debian: apt install nginx)")
    with socket.socket() as probe:  # a free port: nginx cannot listen on 0 and say which
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, upstream=upstream.removeprefix("http://"), port=port))
    proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(tmp)], text=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = tmp / "error.log"
                raise SystemExit(f"nginx did not start: {log.read_text() if log.exists() else 'no error log'}") from None
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------------------------
# measurements


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def latencies(client: httpx.AsyncClient, url: str, concurrency: int, total: int) -> tuple[list[float], float]:
    """Small GETs from a minimal keep-alive HTTP/1.1 client: httpx's own pool collapses at c=64
    (~450 rps on 2 cores) and would hide what the proxy adds."""
    out: list[float] = []
    per_worker = total // concurrency
    hostport, _, path = url.removeprefix("http://").partition("/")
    host, port = hostport.split(":")
    request = f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\n\r\n".encode()

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in range(per_worker):
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head[:40]
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                out.append((time.perf_counter() - t0) * 1000)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, len(out) / (time.perf_counter() - t0)


def cpu_s(proc: psutil.Process | None) -> float:
    """User + system time of the process and its children still running (nginx's worker)."""
    if proc is None:
        return 0.0
    total = 0.0
    for p in (proc, *proc.children()):
        t = p.cpu_times()
        total += t.user + t.system
    return total


async def small_requests(client: httpx.AsyncClient, base: dict[str, str], procs: dict[str, psutil.Process],
                         concurrency: int, rounds: int, per_round: int) -> dict[str, dict[str, float]]:
    """Latency, rate and the relay's own CPU time per request (user + system: the number that sets
    the added latency once the cores are saturated, and far steadier than a p99 on a shared VM)."""
    samples: dict[str, list[float]] = {name: [] for name in base}
    rps: dict[str, list[float]] = {name: [] for name in base}
    cpu: dict[str, list[float]] = {name: [] for name in base}
    for name in base:  # warm the pools
        await latencies(client, base[name] + "/small", concurrency, concurrency * 4)
    for _ in range(rounds):
        for name in base:
            before = cpu_s(procs.get(name))
            lat, r = await latencies(client, base[name] + "/small", concurrency, per_round)
            cpu[name].append((cpu_s(procs.get(name)) - before) / len(lat) * 1e6)
            samples[name] += lat
            rps[name].append(r)
    return {name: {"p50_ms": pct(s, 50), "p99_ms": pct(s, 99), "rps": statistics.median(rps[name]),
                   "relay_cpu_us": statistics.median(cpu[name])}
            for name, s in samples.items()}


async def streaming(client: httpx.AsyncClient, base: dict[str, str], rounds: int) -> dict[str, dict[str, float]]:
    ttfb: dict[str, list[float]] = {"direct": [], "proxy": []}
    delay: dict[str, list[float]] = {"direct": [], "proxy": []}
    for _ in range(rounds):
        for name in ("direct", "proxy"):
            t0 = time.perf_counter()
            first = True
            async with client.stream("POST", base[name] + "/api/generate", content=b"{}") as r:
                async for line in r.aiter_lines():
                    now = time.monotonic_ns()
                    if first:
                        ttfb[name].append((time.perf_counter() - t0) * 1000)
                        first = False
                    delay[name].append((now - json.loads(line)["sent_ns"]) / 1e6)
    return {name: {"ttfb_ms": statistics.median(ttfb[name]), "chunk_delay_ms": statistics.median(delay[name]),
                   "chunk_delay_p99_ms": pct(delay[name], 99)} for name in ttfb}


async def upload(client: httpx.AsyncClient, url: str, proc: psutil.Process | None) -> dict[str, float]:
    block = b"\0" * 2**20
    peak = [0]
    base_rss = proc.memory_info().rss if proc else 0

    async def body() -> AsyncIterator[bytes]:
        for _ in range(UPLOAD_BYTES // len(block)):
            yield block

    async def sample() -> None:
        while proc is not None:
            peak[0] = max(peak[0], proc.memory_info().rss)
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    r = await client.post(url + "/api/blobs/sha256-bench", content=body())
    elapsed = time.perf_counter() - t0
    sampler.cancel()
    assert r.json()["received"] == UPLOAD_BYTES
    out = {"mib_per_s": UPLOAD_BYTES / 2**20 / elapsed}
    if proc is not None:
        out |= {"rss_before_mib": base_rss / 2**20, "rss_peak_mib": peak[0] / 2**20,
                "rss_growth_mib": (peak[0] - base_rss) / 2**20}
    return out


def pin_relays_apart(relays: list[int], others: list[int]) -> dict[str, list[int]]:
    """The relays on the last CPU, this load generator and the upstream on the rest: what a
    machine with a core to spare for the proxy looks like (both direct and proxied runs keep the
    client and upstream on the same CPUs, so the difference is still the proxy's)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    relay_cpu, rest = [cpus[-1]], cpus[:-1]
    for pid in others:
        psutil.Process(pid).cpu_affinity(rest)
    os.sched_setaffinity(0, rest)
    for pid in relays:
        psutil.Process(pid).cpu_affinity(relay_cpu)
    return {"relays": relay_cpu, "client_and_upstream": rest}


async def run(quick: bool, loop: str, pin: bool = False, *, nginx: bool = False, compare: Path | None = None,
              small_only: bool = False, requests: int | None = None, lean: bool = False) -> dict[str, object]:
    up_proc, up_url = spawn("upstream", None)
    px_proc, px_url = spawn("proxy", up_url, loop)
    sp_proc, sp_url = spawn("splice", up_url, loop)
    extra: dict[str, tuple[subprocess.Popen[str], str]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="forwarding-nginx-"))
    if compare is not None:
        extra["baseline"] = spawn("proxy", up_url, loop, root=compare)
    if nginx:
        extra["nginx"] = spawn_nginx(up_url, tmp)
    if lean:
        extra["lean"] = spawn("lean", up_url, loop)
    relays = [px_proc.pid, sp_proc.pid, *(p.pid for p, _ in extra.values())]
    pinned = pin_relays_apart(relays, [up_proc.pid]) if pin else None
    base = {"direct": up_url, "proxy": px_url}
    stream: dict[str, dict[str, float]] | None = None
    uploads: dict[str, dict[str, float]] | None = None
    try:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
            small = base | {"splice": sp_url} | {name: url for name, (_, url) in extra.items()}
            procs = {"proxy": psutil.Process(px_proc.pid), "splice": psutil.Process(sp_proc.pid)} \
                | {name: psutil.Process(p.pid) for name, (p, _) in extra.items()}
            c1 = await small_requests(client, small, procs, 1, 5 if quick else 10, 100 if quick else 300)
            per_round = requests or (640 if quick else 1920)
            c16 = await small_requests(client, small, procs, 16, 3 if quick else 6, per_round)
            c64 = await small_requests(client, small, procs, 64, 3 if quick else 6, per_round)
            if not small_only:
                stream = await streaming(client, base, 5 if quick else 20)
                uploads = {"direct": await upload(client, up_url, None),
                           "proxy": await upload(client, px_url, psutil.Process(px_proc.pid))}
    finally:
        for p in (*(p for p, _ in extra.values()), sp_proc, px_proc, up_proc):
            p.terminate()
            p.wait(5)
        shutil.rmtree(tmp, ignore_errors=True)
    added: dict[str, float] = {"c1_p50_ms": c1["proxy"]["p50_ms"] - c1["direct"]["p50_ms"],
                               "c64_p99_ms": c64["proxy"]["p99_ms"] - c64["direct"]["p99_ms"]}
    if stream is not None and uploads is not None:
        added |= {"ttfb_ms": stream["proxy"]["ttfb_ms"] - stream["direct"]["ttfb_ms"],
                  "chunk_ms": stream["proxy"]["chunk_delay_ms"] - stream["direct"]["chunk_delay_ms"],
                  "upload_rss_growth_mib": uploads["proxy"]["rss_growth_mib"]}
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "quick": quick, "proxy_loop": loop, "pinned": pinned, "compare": str(compare) if compare else None,
            "c1": c1, "c16": c16, "c64": c64, "stream": stream, "upload": uploads, "added": added}


def side_by_side(r: dict[str, object]) -> str:
    """Every relay's small-GET rows in one table (the rounds were interleaved)."""
    c1, c16, c64 = r["c1"], r["c16"], r["c64"]
    assert isinstance(c1, dict) and isinstance(c16, dict) and isinstance(c64, dict)
    names = list(c64)
    rows = [("c=1 p50 (ms)", c1, "p50_ms"), ("c=1 rps", c1, "rps"), ("c=16 rps", c16, "rps"),
            ("c=16 CPU per request (us)", c16, "relay_cpu_us"), ("c=64 p50 (ms)", c64, "p50_ms"),
            ("c=64 p99 (ms)", c64, "p99_ms"), ("c=64 rps", c64, "rps"), ("c=64 CPU per request (us)", c64, "relay_cpu_us")]
    lines = ["| small GET | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, c, key in rows:
        cells = ["" if key == "relay_cpu_us" and name == "direct" else f"{c[name][key]:,.2f}" for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(r: dict[str, Any]) -> str:
    c1, c64, st, up, add = (r[k] for k in ("c1", "c64", "stream", "upload", "added"))
    if st is None:
        return side_by_side(r)

    def small(label: str, c: dict[str, dict[str, float]], key: str, target: str = "") -> tuple[object, ...]:
        d, p, f = c["direct"][key], c["proxy"][key], c["splice"][key]
        return (label, d, p, None if key == "rps" else p - d, f, None if key == "rps" else f - d, target)

    rows = [
        small("small GET c=1 p50 (ms)", c1, "p50_ms", "<= 0.5"),
        small("small GET c=1 p99 (ms)", c1, "p99_ms"),
        small("small GET c=1 rps", c1, "rps"),
        small("small GET c=64 p50 (ms)", c64, "p50_ms"),
        small("small GET c=64 p99 (ms)", c64, "p99_ms", "<= 3"),
        small("small GET c=64 rps", c64, "rps"),
        ("relay CPU per small GET, c=64 (us)", None, c64["proxy"]["relay_cpu_us"], None,
         c64["splice"]["relay_cpu_us"], None, ""),
        ("stream TTFB (ms)", st["direct"]["ttfb_ms"], st["proxy"]["ttfb_ms"], add["ttfb_ms"], None, None, ""),
        ("stream per-chunk delay p50 (ms)", st["direct"]["chunk_delay_ms"], st["proxy"]["chunk_delay_ms"],
         add["chunk_ms"], None, None, "<= 1"),
        ("stream per-chunk delay p99 (ms)", st["direct"]["chunk_delay_p99_ms"], st["proxy"]["chunk_delay_p99_ms"],
         None, None, None, ""),
        ("1 GiB upload (MiB/s)", up["direct"]["mib_per_s"], up["proxy"]["mib_per_s"], None, None, None, ""),
        ("proxy RSS growth, 1 GiB upload (MiB)", None, up["proxy"]["rss_growth_mib"], None, None, None, "< 50"),
    ]
    fmt: Callable[[object], str] = lambda v: "" if v is None else f"{v:,.2f}"  # noqa: E731
    lines = ["| metric | direct | proxy | added | byte splice | splice added | target |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join([str(row[0]), *(fmt(v) for v in row[1:6]), str(row[6])]) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=["upstream", "proxy", "splice", "lean"])
    parser.add_argument("--upstream")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="the relays' event loop (uvloop: pip install uvloop; the product runs asyncio)")
    parser.add_argument("--pin", action="store_true",
                        help="relays on a CPU of their own, client and upstream on the others (default: all share all)")
    parser.add_argument("--nginx", action="store_true", help="nginx beside the proxy in the small-GET rounds")
    parser.add_argument("--lean", action="store_true",
                        help="a lean relay with no ASGI (the client's protocol runs the exchange, GET only) beside "
                             "the proxy in the small-GET rounds: the floor of a protocol-level relay in Python")
    parser.add_argument("--compare", type=Path, metavar="DIR",
                        help="another checkout whose proxy runs beside this one in the small-GET rounds (an A/B)")
    parser.add_argument("--small", action="store_true", help="only the small-GET rows (no stream, no upload)")
    parser.add_argument("--requests", type=int, metavar="N",
                        help="small GETs per relay per round at c=16 and c=64 (default 1,920): the CPU time is read "
                             "in 10 ms ticks, so N sets its resolution (10 ms / N per request)")
    args = parser.parse_args()
    if args.serve:
        if args.serve in ("proxy", "splice") and args.loop == "uvloop":
            import uvloop
            uvloop.run(serve(args.serve, args.upstream))
        else:
            asyncio.run(serve(args.serve, args.upstream))
        return
    if args.compare is not None and not (args.compare / "bench" / "forwarding.py").exists():
        raise SystemExit(f"--compare {args.compare}: no bench/forwarding.py there (a checkout of this repository?)")
    if args.nginx and nginx_binary() is None:
        raise SystemExit("--nginx: no nginx binary found (Debian: apt install nginx)")
    result = asyncio.run(run(args.quick, args.loop, args.pin, nginx=args.nginx, compare=args.compare,
                             small_only=args.small, requests=args.requests, lean=args.lean))
    out = RESULTS.with_name("forwarding-pinned.json") if args.pin else RESULTS
    if args.small or args.nginx or args.compare or args.lean:
        out = out.with_name(out.stem + "-side-by-side.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    if result["stream"] is not None and len(result["c64"]) > 3:  # type: ignore[arg-type]
        print("\n" + side_by_side(result))
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
