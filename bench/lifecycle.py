"""Cold start overhead: what the proxy adds to a stopped app's own start-to-ready time.

Not a test: run `python bench/lifecycle.py [--rounds N] [--load-s S]`. On the `lifecycle` scenario's
simulated box the speech relay (`python -m proxy.sim.relay`, a real child process holding simulated
memory) is a `process` tenant. Each round, interleaved (the order alternates, so drift hits both):

- direct:  spawn the relay's command ourselves and GET /health every 1 ms until it answers 200
           (the app's own start-to-ready time), then time one GET /health to the ready app (one
           direct request); then SIGTERM it and wait until the card shows its memory back;
- proxied: GET /health through the relay's listener while the tenant is stopped, until the
           answer's first byte (the proxy plans the start's memory, starts it, polls its readiness,
           forwards); then stop it through the admin API.

added = proxied - (direct start-to-ready + one direct request), per round; medians reported, with
the machine (`nproc`, `uname -m`). Target: median added <= 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.demo import Demo, start_demo
from proxy.lifecycle.process import ProcessRelease
from proxy.sim.box import fast_scenario
from proxy.tasks import poll_until

TENANT = "stt"


async def _direct(demo: Demo, client: httpx.AsyncClient) -> tuple[float, float]:
    """(start-to-ready, one request) of the relay spawned by us, in seconds."""
    assert demo.proxy is not None
    tenant = demo.proxy.registry.get(TENANT)
    assert isinstance(tenant.lifecycle, ProcessRelease) and tenant.lifecycle.command is not None and tenant.upstream
    url = tenant.upstream + "/health"
    began = time.perf_counter()
    child = await asyncio.create_subprocess_exec(*tenant.lifecycle.command, stdout=asyncio.subprocess.DEVNULL,
                                                 stderr=asyncio.subprocess.DEVNULL)
    try:
        while True:
            try:
                if (await client.get(url)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.001)
        ready = time.perf_counter() - began
        t = time.perf_counter()
        async with client.stream("GET", url) as r:
            assert r.status_code == 200
        one = time.perf_counter() - t
    finally:
        child.terminate()
        await child.wait()
    async with asyncio.timeout(10):
        await poll_until(lambda: child.pid not in demo.box.gpu.real_pids(), 0.002)
    return ready, one


async def _proxied(demo: Demo, client: httpx.AsyncClient) -> float:
    """Request -> first byte through the proxy to the stopped tenant, in seconds; stops it after."""
    assert demo.proxy is not None
    machine = demo.proxy.broker.lifecycles.machine(TENANT)
    assert machine is not None and machine.state == "stopped", machine and machine.state
    began = time.perf_counter()
    async with client.stream("GET", demo.proxy.url(TENANT) + "/health") as r:
        first = time.perf_counter() - began  # the status line and headers: the answer's first bytes
        assert r.status_code == 200, await r.aread()
    released = await client.post(demo.proxy.url("admin") + f"/api/tenants/{TENANT}/release")
    assert released.status_code == 200 and machine.state == "stopped", released.text
    return first


async def main(rounds: int, load_s: float) -> dict[str, object]:
    scenario = fast_scenario("lifecycle", relay={"load_s": load_s})
    # The first request is a GET of the app's /health, the probe's own path, so the proxied figure is
    # the direct one plus what the proxy adds; a read starts a stopped app only with wake_on "any"
    # (the shipped "writes" keeps polls from starting it).
    scenario.tenants.setdefault(TENANT, {})["wake_on"] = "any"
    demo = await start_demo(scenario, sim_ports={"ollama": 0, "comfyui": 0, "relay": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0, TENANT: 0}, watchdog=False)
    rows: list[dict[str, float]] = []
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            await _proxied(demo, client)  # one of each first: the interpreter's files in the page cache
            await _direct(demo, client)
            for i in range(rounds):
                if i % 2:
                    proxied = await _proxied(demo, client)
                    ready, one = await _direct(demo, client)
                else:
                    ready, one = await _direct(demo, client)
                    proxied = await _proxied(demo, client)
                rows.append({"direct_ready_ms": ready * 1e3, "direct_request_ms": one * 1e3,
                             "proxied_ms": proxied * 1e3, "added_ms": (proxied - ready - one) * 1e3,
                             "ratio": proxied / (ready + one)})
    finally:
        await demo.stop()
    med = {k: round(statistics.median(r[k] for r in rows), 2 if k != "ratio" else 3) for k in rows[0]}
    return {
        "rounds": rounds, "load_s": load_s, "median": med,
        "added_ms_each": [round(r["added_ms"], 1) for r in rows],
        "ratio_each": [round(r["ratio"], 3) for r in rows],
        "target": "median added <= 50 ms",
        "machine": {"nproc": os.cpu_count(), "uname_m": platform.machine(), "python": platform.python_version()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--load-s", type=float, default=0.5, help="the relay's model load (seconds)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.rounds, args.load_s)), indent=2))
