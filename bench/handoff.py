"""Handoff overhead: what the proxy adds to the engines' own release and load time.

Not a test: run `python bench/handoff.py [--rounds N]`. On the simulated box (one process, real
sockets), each round makes ComfyUI hold a large checkpoint, then times a request for an Ollama
model that only fits once ComfyUI lets go:

- direct:  POST /free to ComfyUI, watch the simulated GPU (1 ms polls) until the memory is back,
           then POST /api/generate to Ollama directly: the engines' own release + load + first token;
- proxied: POST /api/generate through the proxy, which plans, releases, confirms and forwards.

overhead = proxied - direct, per round (interleaved, so drift hits both), median reported.
Also: plan_release for 10 tenants / 200 processes is in bench/arbiter.py.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo import run_prompt, start_demo  # noqa: E402
from proxy.sim.box import Scenario, load_scenario  # noqa: E402
from proxy.tenants import GIB  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "handoff.json"
CKPT = "flux1-dev-fp8.safetensors"
MODEL = "gemma3:27b"


def scenario() -> Scenario:
    data = load_scenario("default").model_dump()
    data["ollama"].update({"load_gbps": 40.0, "unload_delay_s": 0.3, "token_rate": 1000.0})
    data["comfyui"].update({"free_delay_s": 0.3, "load_gbps": 200.0, "step_time_s": 0.001})
    return Scenario.model_validate(data)


async def ttfb(client: httpx.AsyncClient, url: str) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url + "/api/generate", json={"model": MODEL, "prompt": "hi"}) as r:
        async for _ in r.aiter_raw():
            elapsed = time.perf_counter() - start
            break
        else:
            raise RuntimeError(f"no body from {url}: {r.status_code}")
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}")
    return elapsed


async def main(rounds: int) -> dict[str, object]:
    demo = await start_demo(scenario(), sim_ports={"ollama": 0, "comfyui": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0}, watchdog=False)
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    comfy_direct = demo.box.servers["comfyui"].url
    ollama_direct = demo.box.servers["ollama"].url
    gpu = demo.box.gpu
    direct_s: list[float] = []
    proxied_s: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            async def reset() -> None:
                await client.post(ollama_direct + "/api/generate", json={"model": MODEL, "keep_alive": 0})
                await demo.box.ollama.wait_until(lambda: not demo.box.ollama.loaded())
                await run_prompt(comfy_direct, CKPT, client)
                assert gpu.used_by(demo.box.comfyui.pid) > 11 * GIB

            for _ in range(rounds):
                await reset()
                start = time.perf_counter()
                floor = demo.box.comfyui.config.context_floor_bytes
                await client.post(comfy_direct + "/free", json={"unload_models": True, "free_memory": True})
                while gpu.used_by(demo.box.comfyui.pid) > floor + 64 * 2**20:
                    await asyncio.sleep(0.001)
                released = time.perf_counter() - start
                direct_s.append(released + await ttfb(client, ollama_direct))

                await reset()
                proxied_s.append(await ttfb(client, demo.proxy.url("ollama")))
    finally:
        await demo.stop()
    overhead = [p - d for p, d in zip(proxied_s, direct_s)]
    return {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "rounds": rounds,
        "direct_median_s": statistics.median(direct_s),
        "proxied_median_s": statistics.median(proxied_s),
        "overhead_median_ms": statistics.median(overhead) * 1000,
        "overhead_p90_ms": sorted(overhead)[int(0.9 * (len(overhead) - 1))] * 1000,
        "target_ms": 50,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    result = asyncio.run(main(parser.parse_args().rounds))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print("| rounds | direct (engines' own) median | through proxy median | overhead median | overhead p90 | target |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['rounds']} | {result['direct_median_s'] * 1000:.0f} ms | {result['proxied_median_s'] * 1000:.0f} ms "
          f"| {result['overhead_median_ms']:.1f} ms | {result['overhead_p90_ms']:.1f} ms | <= 50 ms |")
