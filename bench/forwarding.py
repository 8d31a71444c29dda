"""Forwarding overhead: direct to a minimal upstream vs through a HyperSwap tenant listener.

Not a test: run `python bench/forwarding.py` (about a minute). The upstream and the proxy each run in
their own process (so the proxy's RSS can be read with psutil); direct and proxied runs are
interleaved in one session so drift hits both equally. Prints a table and writes
bench/results/forwarding.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "forwarding.json"
CHUNKS = 50
CHUNK_GAP_S = 0.002
UPLOAD_BYTES = 2**30


# --------------------------------------------------------------------------------------------
# the two server processes


def upstream_app():  # type: ignore[no-untyped-def]
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


async def serve(role: str, upstream: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    from proxy.servers import start_server

    if role == "upstream":
        app = upstream_app()
    else:
        from proxy.forward import Forwarder
        from proxy.inflight import InFlight
        from proxy.listener import tenant_app
        from proxy.tenants import Tenant

        tenant = Tenant(name="bench", engine="ollama", upstream=upstream)
        app = tenant_app(tenant, Forwarder(), InFlight())
    server = await start_server(app, name=role)
    print(server.port, flush=True)
    await asyncio.Event().wait()


def spawn(role: str, upstream: str | None, loop: str = "asyncio") -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, __file__, "--serve", role, "--loop", loop] \
        + (["--upstream", upstream] if upstream else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
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


async def small_requests(client: httpx.AsyncClient, base: dict[str, str], concurrency: int, rounds: int,
                         per_round: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[float]] = {"direct": [], "proxy": []}
    rps: dict[str, list[float]] = {"direct": [], "proxy": []}
    for name in base:  # warm the pools
        await latencies(client, base[name] + "/small", concurrency, concurrency * 4)
    for _ in range(rounds):
        for name in ("direct", "proxy"):
            lat, r = await latencies(client, base[name] + "/small", concurrency, per_round)
            samples[name] += lat
            rps[name].append(r)
    return {name: {"p50_ms": pct(s, 50), "p99_ms": pct(s, 99), "rps": statistics.median(rps[name])}
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


async def run(quick: bool, loop: str) -> dict[str, object]:
    up_proc, up_url = spawn("upstream", None)
    px_proc, px_url = spawn("proxy", up_url, loop)
    base = {"direct": up_url, "proxy": px_url}
    try:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
            c1 = await small_requests(client, base, 1, 5 if quick else 10, 100 if quick else 300)
            c64 = await small_requests(client, base, 64, 3 if quick else 6, 640 if quick else 1920)
            stream = await streaming(client, base, 5 if quick else 20)
            up_direct = await upload(client, up_url, None)
            up_proxy = await upload(client, px_url, psutil.Process(px_proc.pid))
    finally:
        for p in (px_proc, up_proc):
            p.terminate()
            p.wait(5)
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "quick": quick, "proxy_loop": loop,
            "c1": c1, "c64": c64, "stream": stream, "upload": {"direct": up_direct, "proxy": up_proxy},
            "added": {"c1_p50_ms": c1["proxy"]["p50_ms"] - c1["direct"]["p50_ms"],
                      "c64_p99_ms": c64["proxy"]["p99_ms"] - c64["direct"]["p99_ms"],
                      "ttfb_ms": stream["proxy"]["ttfb_ms"] - stream["direct"]["ttfb_ms"],
                      "chunk_ms": stream["proxy"]["chunk_delay_ms"] - stream["direct"]["chunk_delay_ms"],
                      "upload_rss_growth_mib": up_proxy["rss_growth_mib"]}}


def table(r: dict[str, object]) -> str:
    c1, c64, st, up, add = (r[k] for k in ("c1", "c64", "stream", "upload", "added"))  # type: ignore[misc]
    rows = [
        ("small GET c=1 p50 (ms)", c1["direct"]["p50_ms"], c1["proxy"]["p50_ms"], add["c1_p50_ms"], "<= 0.5"),
        ("small GET c=1 p99 (ms)", c1["direct"]["p99_ms"], c1["proxy"]["p99_ms"], c1["proxy"]["p99_ms"] - c1["direct"]["p99_ms"], ""),
        ("small GET c=1 rps", c1["direct"]["rps"], c1["proxy"]["rps"], None, ""),
        ("small GET c=64 p50 (ms)", c64["direct"]["p50_ms"], c64["proxy"]["p50_ms"], c64["proxy"]["p50_ms"] - c64["direct"]["p50_ms"], ""),
        ("small GET c=64 p99 (ms)", c64["direct"]["p99_ms"], c64["proxy"]["p99_ms"], add["c64_p99_ms"], "<= 3"),
        ("small GET c=64 rps", c64["direct"]["rps"], c64["proxy"]["rps"], None, ""),
        ("stream TTFB (ms)", st["direct"]["ttfb_ms"], st["proxy"]["ttfb_ms"], add["ttfb_ms"], ""),
        ("stream per-chunk delay p50 (ms)", st["direct"]["chunk_delay_ms"], st["proxy"]["chunk_delay_ms"], add["chunk_ms"], "<= 1"),
        ("stream per-chunk delay p99 (ms)", st["direct"]["chunk_delay_p99_ms"], st["proxy"]["chunk_delay_p99_ms"], None, ""),
        ("1 GiB upload (MiB/s)", up["direct"]["mib_per_s"], up["proxy"]["mib_per_s"], None, ""),
        ("proxy RSS growth, 1 GiB upload (MiB)", None, up["proxy"]["rss_growth_mib"], None, "< 50"),
    ]
    fmt = lambda v: "" if v is None else f"{v:,.2f}"  # noqa: E731
    lines = [f"| metric | direct | proxy | added | target |", "|---|---:|---:|---:|---|"]
    lines += [f"| {n} | {fmt(d)} | {fmt(p)} | {fmt(a)} | {t} |" for n, d, p, a, t in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=["upstream", "proxy"])
    parser.add_argument("--upstream")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="the proxy's event loop")
    args = parser.parse_args()
    if args.serve:
        if args.serve == "proxy" and args.loop == "uvloop":
            import uvloop
            uvloop.run(serve(args.serve, args.upstream))
        else:
            asyncio.run(serve(args.serve, args.upstream))
        return
    result = asyncio.run(run(args.quick, args.loop))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
