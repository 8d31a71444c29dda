"""Soak: many concurrent streams through a tenant listener for a while, against a minimal upstream.

Not a test: run `python bench/soak.py` (1,000 concurrent streams for 60 s, about 75 s in all), or
a shorter run with `--streams 200 --duration 20` (`--quick`: 100 streams, 10 s). The upstream, the
proxy and this load generator each run in a process of their own, on loopback only. Each of the
`--streams` clients keeps one generation stream open at all times: POST /api/generate (the GPU
path: counted in flight, body kept for an OOM retry), a chunk every `--chunk-gap-s` for
`--stream-s`, then the next request on the same kept-alive connection. Clients start spread over
one chunk gap (all at once, every chunk of every stream would arrive in the same instant). At
`--duration` every client closes its connection, mid-stream or not (the proxy must then drop each
upstream request). `--rounds N` repeats the load against the same proxy: RSS that grows round
after round is a leak, RSS that stays at the first round's level is the allocator keeping memory.

Reports requests, chunks and errors (by kind), the per-chunk delay from the upstream's clock to
the client (both on this machine's monotonic clock), the proxy's CPU time, and its RSS and open
descriptors before the load, at its peak, and after each round (once the last stream ended).
Writes bench/results/soak.json.
The per-listener connection cap (2048) and the per-upstream cap (1024) bound --streams: past them
the soak measures the caps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
SETTLE_S = 2.0  # after the load, before the "after" sample: relays finish closing


def raise_fd_limit() -> None:
    """Each stream costs a descriptor in the client and the upstream and two in the proxy."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------------------------
# the upstream and the proxy, each in a process of its own


async def serve_upstream(stream_s: float, gap_s: float) -> None:
    """The least an engine can be: reads a request head and body, streams timestamped NDJSON lines
    (chunked), then the next request on the same connection."""
    chunks = max(1, round(stream_s / gap_s))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                               if line.startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(chunks):
                    line = b'{"sent_ns": %d, "done": %s}\n' % (time.monotonic_ns(), b"true" if i == chunks - 1 else b"false")
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                    await writer.drain()
                    if i < chunks - 1:
                        await asyncio.sleep(gap_s)
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


async def serve_proxy(upstream: str) -> None:
    sys.path.insert(0, str(ROOT))
    from proxy.config.schema import Tenant
    from proxy.handoff.inflight import InFlight
    from proxy.relay.forward import Forwarder
    from proxy.relay.listener import TenantApp
    from proxy.relay.servers import settle_heap, start_server

    tenant = Tenant(name="soak", engine="ollama", upstream=upstream)
    server = await start_server(TenantApp(tenant, Forwarder(), InFlight()), name="soak")
    settle_heap()  # as `hyperswap serve` does once started
    print(server.port, flush=True)
    await asyncio.Event().wait()


def spawn(*args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


# --------------------------------------------------------------------------------------------
# the load


@dataclass
class Tally:
    requests: int = 0
    cut: int = 0  # streams still open at the end, closed by their client
    chunks: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    delays_ms: list[float] = field(default_factory=list)


async def one_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tally: Tally, timeout_s: float) -> bool:
    """One generation stream on a kept-alive connection; False when the connection is unusable."""
    body = b'{"model": "soak", "prompt": "hi"}'
    writer.write(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        tally.errors[f"status {head[9:12].decode()}"] += 1
        return False
    while True:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation that ends the soak.
        async with asyncio.timeout(timeout_s):
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
        if size == 0:
            tally.requests += 1
            return True
        now = time.monotonic_ns()
        for line in data[:-2].splitlines():  # the proxy may hand over two lines at once
            tally.chunks += 1
            if len(tally.delays_ms) < 200_000:
                tally.delays_ms.append((now - json.loads(line)["sent_ns"]) / 1e6)


async def client(port: int, start_after_s: float, deadline: float, tally: Tally, timeout_s: float) -> None:
    """Keeps one stream open until the deadline (loop time), reconnecting after any error; the
    stream open at the deadline is cut by closing the connection."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(deadline):
            await asyncio.sleep(start_after_s)
            while loop.time() < deadline:
                await connection(port, tally, timeout_s)
    except TimeoutError:
        tally.cut += 1


async def connection(port: int, tally: Tally, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError) as exc:
        tally.errors[f"connect: {type(exc).__name__}"] += 1
        await asyncio.sleep(0.1)
        return
    try:
        while await one_stream(reader, writer, tally, timeout_s):
            pass
    except TimeoutError:
        tally.errors["timeout"] += 1
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        tally.errors[f"stream: {type(exc).__name__}"] += 1
    finally:
        writer.close()


def sample(proc: psutil.Process) -> dict[str, float]:
    t = proc.cpu_times()
    return {"rss_mib": proc.memory_info().rss / 2**20, "fds": proc.num_fds(), "cpu_s": t.user + t.system}


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else float("nan")


async def soak(streams: int, duration_s: float, stream_s: float, gap_s: float, rounds: int) -> dict[str, object]:
    up_proc, up_port = spawn("--serve", "upstream", "--stream-s", str(stream_s), "--chunk-gap-s", str(gap_s))
    px_proc, px_port = spawn("--serve", "proxy", "--upstream", f"http://127.0.0.1:{up_port}")
    proxy = psutil.Process(px_proc.pid)
    loop = asyncio.get_running_loop()
    try:
        before = sample(proxy)
        peak = dict(before)
        tally = Tally()
        timeout_s = max(10.0, 4 * gap_s)
        after_rounds: list[dict[str, float]] = []

        async def watch() -> None:
            while True:
                now = sample(proxy)
                peak["rss_mib"] = max(peak["rss_mib"], now["rss_mib"])
                peak["fds"] = max(peak["fds"], now["fds"])
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        t0 = time.monotonic()
        for _ in range(rounds):
            deadline = loop.time() + duration_s
            async with asyncio.timeout(duration_s + 2 * timeout_s):  # the soak ends, whatever a client does
                await asyncio.gather(*(client(px_port, gap_s * i / streams, deadline, tally, timeout_s)
                                       for i in range(streams)))
            await asyncio.sleep(SETTLE_S)
            after_rounds.append(sample(proxy))
        elapsed = time.monotonic() - t0 - rounds * SETTLE_S
        watcher.cancel()
        after = after_rounds[-1]
    finally:
        for proc in (px_proc, up_proc):
            proc.terminate()
            proc.wait(5)
    return {
        "machine": {"cpus": os.cpu_count(), "cpu": _cpu_name(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "load": {"streams": streams, "duration_s": duration_s, "rounds": rounds, "stream_s": stream_s,
                 "chunk_gap_s": gap_s, "elapsed_s": round(elapsed, 1)},
        "requests": tally.requests, "cut_at_end": tally.cut, "chunks": tally.chunks, "errors": dict(tally.errors),
        "chunk_delay_ms": {"p50": pct(tally.delays_ms, 50), "p99": pct(tally.delays_ms, 99),
                           "max": max(tally.delays_ms, default=float("nan"))},
        "proxy": {"before": before, "peak": peak, "after": after, "after_each_round": after_rounds,
                  "cpu_s_during": after["cpu_s"] - before["cpu_s"]},
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def report(r: dict[str, Any]) -> str:
    load, px, delay = r["load"], r["proxy"], r["chunk_delay_ms"]
    b, p, a = px["before"], px["peak"], px["after"]
    errors = r["errors"] or {}
    rounds = px["after_each_round"]
    lines = [
        f"{load['streams']} concurrent streams for {load['elapsed_s']} s in {load['rounds']} round(s) "
        f"(a chunk every {load['chunk_gap_s']} s, {load['stream_s']} s per stream)",
        f"requests completed: {r['requests']:,} (and {r['cut_at_end']:,} cut at the end)   chunks: {r['chunks']:,}   "
        f"errors: {sum(errors.values())} {errors if errors else ''}",
        f"chunk delay upstream -> client: p50 {delay['p50']:.2f} ms, p99 {delay['p99']:.2f} ms, "
        f"max {delay['max']:.1f} ms",
        "| proxy | before | peak | after |", "|---|---:|---:|---:|",
        f"| RSS (MiB) | {b['rss_mib']:.1f} | {p['rss_mib']:.1f} | {a['rss_mib']:.1f} |",
        f"| open descriptors | {b['fds']} | {p['fds']} | {a['fds']} |",
        "proxy RSS after each round (MiB): " + ", ".join(f"{r['rss_mib']:.1f}" for r in rounds),
        f"proxy CPU during the soak: {px['cpu_s_during']:.1f} s",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams (default 1000)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--stream-s", type=float, default=10.0, help="how long each stream lasts (default 10)")
    parser.add_argument("--chunk-gap-s", type=float, default=0.5, help="seconds between chunks (default 0.5)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the load against the same proxy (default 1)")
    parser.add_argument("--quick", action="store_true", help="100 streams for 10 s (a smoke run)")
    parser.add_argument("--serve", choices=["upstream", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    raise_fd_limit()
    if args.serve == "upstream":
        asyncio.run(serve_upstream(args.stream_s, args.chunk_gap_s))
        return
    if args.serve == "proxy":
        asyncio.run(serve_proxy(args.upstream))
        return
    streams, duration = (100, 10.0) if args.quick else (args.streams, args.duration)
    result = asyncio.run(soak(streams, duration, args.stream_s, args.chunk_gap_s, args.rounds))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
