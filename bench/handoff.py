"""Handoff overhead: what the proxy adds to the engines' own release and load time.

Not a test: run `python bench/handoff.py [--rounds N]`. On the simulated box (one process, real
sockets), each round makes ComfyUI hold a large checkpoint, then times a request for an Ollama
model that only fits once ComfyUI lets go:

- direct:  POST /free to ComfyUI, watch the simulated GPU (1 ms polls) until the memory is back,
           then POST /api/generate to Ollama directly: the engines' own release + load + first token;
- proxied: POST /api/generate through the proxy, which plans, releases, confirms and forwards.

overhead = proxied - direct, per round (interleaved, so drift hits both), median reported.

Wait for busy (`--wait`): ComfyUI renders a prompt (its websocket open through the proxy) while an
Ollama request that needs ComfyUI's memory arrives. From the prompt's end marker reaching the
client to the Ollama request's first byte:
- direct:  the client itself POSTs /free at the end marker, watches the GPU, then generates;
- proxied: the request waited in the proxy's handoff queue and is forwarded once the prompt ended.

Resident (`--resident`): time to first byte of a streamed generation of a model already on the card,
direct vs through the proxy, interleaved, with the simulated GPU reader and with a broken one
(the engines' self-reports are the fallback, which used to cost two engine calls per request).
Warm during release (`--warm`): the handoff ComfyUI -> Ollama (gemma3:27b, 17.4 GB) with the model's
file cold in the page cache, timed request -> first byte through the proxy, three ways interleaved:
- off:  proxy.warm_during_release false: the release, then a load that reads the file from disk;
- on:   the proxy reads the file into RAM while ComfyUI releases; the load reads what is cached
        by then at RAM speed and the rest from disk;
- warm: the file already in RAM (what proxy.keep_warm_models gives a model used recently).
The simulated load reads at --ram-gbps from the page cache and --disk-gbps from disk, by the
residency of its stand-in file measured at the start of the load. The stand-in files are 1/1024 of
the model's size (sparse), so the proxy's warm of them is throttled to --disk-gbps of the full size:
it reads like a disk would, and only the part read before the load starts is won.
Swap hold (`--swap-hold-s S`, any mode): the proxy's swap_hold_s set to S. The reset's render goes
straight to ComfyUI, so the proxy saw no ComfyUI work and a lone swap is not held; `--recent` sends
that render through the proxy instead, so ComfyUI's work ended just before the Ollama request (within
swap_hold_recent_s): the swap is held, the worst case for a lone swap.
Suspend (`--suspend`): the handoff back to ComfyUI after a chat by CUDA suspension (release kind
cuda_suspend: parked in host RAM, restored) against unload and reload, SIMULATED at the demo's
configured rates (bench/handoff_suspend.py says how; bench/device_suspend.py is for a real card).
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
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect as ws_connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.config.units import GIB  # noqa: E402
from proxy.demo import Demo, comfy_prompt, run_prompt, start_demo  # noqa: E402
from proxy.gpu.snapshot import GpuReadError, GpuSnapshot  # noqa: E402
from proxy.sim.box import Scenario, load_scenario  # noqa: E402
from proxy.tasks import poll_until  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "handoff.json"
CKPT = "flux1-dev-fp8.safetensors"
MODEL = "gemma3:27b"
PROXY: dict[str, object] = {}  # the proxy's settings over the scenario's (--swap-hold-s)
RECENT = {"on": False}  # --recent: the reset's render goes through the proxy


def scenario() -> Scenario:
    data = load_scenario("default").model_dump()
    data["ollama"].update({"load_gbps": 40.0, "unload_delay_s": 0.3, "token_rate": 1000.0})
    data["comfyui"].update({"free_delay_s": 0.3, "load_gbps": 200.0, "step_time_s": 0.001})
    return Scenario.model_validate(data)


async def ttfb(client: httpx.AsyncClient, url: str, model: str = MODEL) -> float:
    """Time to the first body byte; the rest of the answer is read too, so no generation is cut
    short and left running into the next round."""
    start = time.perf_counter()
    elapsed = None
    # progress lines off: the first byte timed is the engine's, not the proxy's "waiting for ..." line
    async with client.stream("POST", url + "/api/generate", json={"model": model, "prompt": "hi"},
                             headers={"X-HyperSwap-Progress": "off"}) as r:
        async for _ in r.aiter_raw():
            if elapsed is None:
                elapsed = time.perf_counter() - start
        if r.status_code != 200 or elapsed is None:
            raise RuntimeError(f"{url} answered {r.status_code}")
    return elapsed


async def start_box(watchdog: bool = False) -> Demo:
    """The bench scenario, every port picked by the system."""
    config = None
    if PROXY:
        config = Path(tempfile.mkdtemp(prefix="bench-handoff-")) / "tenants.json"
        config.write_text(json.dumps({"proxy": PROXY}))
    demo = await start_demo(scenario(), sim_ports={"ollama": 0, "comfyui": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0}, watchdog=watchdog, config=config)
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    return demo


async def reset(demo: Demo, client: httpx.AsyncClient) -> None:
    """Ollama holds nothing (unloaded through the proxy, as a client would, so it knows the model left
    the card) and ComfyUI holds the large checkpoint, idle."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui and demo.box.comfyui.pid and demo.box.files
    ollama = demo.box.ollama
    await client.post(demo.proxy.url("ollama") + "/api/generate", json={"model": MODEL, "keep_alive": 0})
    await ollama.wait_until(lambda: not ollama.loaded())
    await run_prompt(demo.proxy.url("comfyui") if RECENT["on"] else demo.box.servers["comfyui"].url, CKPT, client)
    assert demo.box.gpu.used_by(demo.box.comfyui.pid) > 11 * GIB
    # The model's file in RAM, so direct and proxied loads read at the same speed (the simulated load
    # time follows residency); --warm drops it again after this for the modes that need it cold.
    demo.box.files.engine_read(demo.box.files.ollama_blob(MODEL))


async def main(rounds: int) -> dict[str, object]:
    demo = await start_box()
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    comfy_direct = demo.box.servers["comfyui"].url
    ollama_direct = demo.box.servers["ollama"].url
    gpu, comfy = demo.box.gpu, demo.box.comfyui
    direct_s: list[float] = []
    proxied_s: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            floor = demo.box.comfyui.config.context_floor_bytes
            for _ in range(rounds):
                await reset(demo, client)
                start = time.perf_counter()
                await client.post(comfy_direct + "/free", json={"unload_models": True, "free_memory": True})
                await poll_until(lambda: gpu.used_by(comfy.pid or 0) <= floor + 64 * 2**20, 0.001)
                released = time.perf_counter() - start
                direct_s.append(released + await ttfb(client, ollama_direct))

                await reset(demo, client)
                proxied_s.append(await ttfb(client, demo.proxy.url("ollama")))
    finally:
        await demo.stop()
    overhead = [p - d for p, d in zip(proxied_s, direct_s, strict=True)]
    return {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "rounds": rounds,
        "direct_median_s": statistics.median(direct_s),
        "proxied_median_s": statistics.median(proxied_s),
        "overhead_median_ms": statistics.median(overhead) * 1000,
        "overhead_p90_ms": sorted(overhead)[int(0.9 * (len(overhead) - 1))] * 1000,
        "target_ms": 50,
    }


async def _chat_behind_render(demo: Demo, client: httpx.AsyncClient) -> float:
    """A chat sent through the proxy while a 200-step render runs: seconds from the render's end marker to
    the chat's first byte (the wait-for-busy handoff)."""
    assert demo.proxy is not None
    started = asyncio.Event()
    rendering = asyncio.ensure_future(_render_until_end(demo.proxy.url("comfyui"), 200, started))
    await started.wait()
    chat = asyncio.ensure_future(ttfb(client, demo.proxy.url("ollama")))
    end = await rendering
    await chat
    return time.perf_counter() - end


async def _render_until_end(base: str, steps: int, started: asyncio.Event) -> float:
    """Queue a prompt with its websocket open; return the perf_counter time its end marker arrived."""
    cid = uuid.uuid4().hex
    prompt: dict[str, Any] = comfy_prompt(CKPT)
    prompt["3"]["inputs"]["steps"] = steps
    async with ws_connect(base.replace("http://", "ws://") + f"/ws?clientId={cid}", max_size=None) as ws:
        await ws.recv()
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            r = await client.post(base + "/prompt", json={"prompt": prompt, "client_id": cid})
            r.raise_for_status()
        started.set()
        while True:
            raw = await ws.recv()
            if isinstance(raw, str) and '"node": null' in raw:
                return time.perf_counter()


async def wait_for_busy(rounds: int) -> dict[str, object]:
    demo = await start_box()
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    comfy_direct, ollama_direct = demo.box.servers["comfyui"].url, demo.box.servers["ollama"].url
    gpu, floor, comfy = demo.box.gpu, demo.box.comfyui.config.context_floor_bytes, demo.box.comfyui
    direct_s: list[float] = []
    proxied_s: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            for _ in range(rounds):
                await reset(demo, client)
                started = asyncio.Event()
                end = await _render_until_end(comfy_direct, 200, started)
                await client.post(comfy_direct + "/free", json={"unload_models": True, "free_memory": True})
                await poll_until(lambda: gpu.used_by(comfy.pid or 0) <= floor + 64 * 2**20, 0.001)
                first = await ttfb(client, ollama_direct)
                del first
                direct_s.append(time.perf_counter() - end)

                await reset(demo, client)
                proxied_s.append(await _chat_behind_render(demo, client))
    finally:
        await demo.stop()
    added = [p - d for p, d in zip(proxied_s, direct_s, strict=True)]
    return {"rounds": rounds, "direct_median_s": statistics.median(direct_s),
            "proxied_median_s": statistics.median(proxied_s),
            "added_median_ms": statistics.median(added) * 1000, "target_ms": 50}


class _BrokenReader:
    """A GPU reader that fails as NVML does without a driver: the proxy falls back to the engines."""

    def read(self) -> GpuSnapshot:
        raise GpuReadError("driver_not_loaded", "NVML: driver not loaded", "install the NVIDIA driver")


async def resident(rounds: int) -> dict[str, object]:
    small = "llama3.2:3b"
    out: dict[str, object] = {"rounds": rounds, "model": small}
    for reader in ("simulated", "broken"):
        demo = await start_box(watchdog=True)
        assert demo.proxy
        if reader == "broken":
            demo.proxy.broker.reader = _BrokenReader()
        direct_s: list[float] = []
        proxied_s: list[float] = []
        try:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                await ttfb(client, demo.proxy.url("ollama"), small)  # loaded through the proxy: resident
                for _ in range(rounds):
                    direct_s.append(await ttfb(client, demo.box.servers["ollama"].url, small))
                    proxied_s.append(await ttfb(client, demo.proxy.url("ollama"), small))
        finally:
            await demo.stop()
        out[reader] = {"direct_median_ms": statistics.median(direct_s) * 1000,
                       "proxied_median_ms": statistics.median(proxied_s) * 1000,
                       "added_median_ms": (statistics.median(proxied_s) - statistics.median(direct_s)) * 1000}
    return out


async def warm_during_release(rounds: int, ram_gbps: float, disk_gbps: float) -> dict[str, object]:
    from proxy.admin.models_api import ModelsExtension
    from proxy.models.warm import read_mem_available
    from proxy.sim.model_files import SCALE

    data = load_scenario("default").model_dump()
    data["ollama"].update({"load_gbps": ram_gbps, "disk_gbps": disk_gbps, "token_rate": 1000.0})
    data["comfyui"].update({"load_gbps": 200.0, "disk_gbps": None, "step_time_s": 0.05})
    demo = await start_demo(Scenario.model_validate(data), sim_ports={"ollama": 0, "comfyui": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0}, watchdog=False)
    assert demo.proxy and demo.box.files and demo.box.ollama
    ext = next(e for e in demo.proxy.extensions if isinstance(e, ModelsExtension))
    chunk = 256 * 1024
    ext.warmer.chunk_bytes = chunk
    ext.warmer.advice = os.POSIX_FADV_RANDOM  # no kernel readahead: 1/1024 files would read 1024x ahead of the pace

    def disk_paced() -> int | None:  # called before each chunk, in the warm's thread
        time.sleep(chunk * SCALE / (disk_gbps * 1e9))
        return read_mem_available()

    ext.warmer.mem_available = disk_paced
    if not demo.box.files.drop_all():
        raise SystemExit(f"{demo.box.files.root}: this file system cannot drop pages (tmpfs?): nothing to measure")
    settings = ext.settings
    modes = ("off", "on", "warm", "wait-off", "wait-on")
    times: dict[str, list[float]] = {m: [] for m in modes}
    residency: dict[str, list[float]] = {m: [] for m in modes}
    released: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for _ in range(rounds):
                for mode in modes:
                    await reset(demo, client)
                    ext.settings = settings.model_copy(update={"warm_during_release": mode in ("on", "wait-on")})
                    demo.box.files.drop_all()
                    if mode == "warm":
                        demo.box.files.engine_read(demo.box.files.ollama_blob(MODEL))
                    if mode.startswith("wait"):  # the request arrives while ComfyUI renders (10 s) and waits for it
                        times[mode].append(await _chat_behind_render(demo, client))  # from the end marker, as --wait
                    else:
                        times[mode].append(await ttfb(client, demo.proxy.url("ollama")))
                    await ext.warmer.wait(f"ollama:{MODEL}")
                    load = next(r for r in reversed(ext.loads.records) if r.model == MODEL)
                    residency[mode].append(load.resident_before or 0.0)
                    plan = next(d for d in reversed(demo.proxy.decisions.recent()) if d.kind == "plan")
                    outcome: dict[str, Any] = plan.outcome
                    released.append(sum(r["duration_s"] for r in outcome.get("releases", [])))
    finally:
        ext.settings = settings
        await demo.stop()
    return {"rounds": rounds, "ram_gbps": ram_gbps, "disk_gbps": disk_gbps, "model": MODEL,
            "release_median_s": statistics.median(released),
            **{f"{m}_median_s": statistics.median(v) for m, v in times.items()},
            **{f"{m}_resident_before_median": statistics.median(v) for m, v in residency.items()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--wait", action="store_true", help="measure the wait-for-busy path instead")
    parser.add_argument("--resident", action="store_true", help="measure a model already on the card instead")
    parser.add_argument("--warm", action="store_true", help="measure the handoff with and without warm-during-release")
    parser.add_argument("--ram-gbps", type=float, default=2.63, help="--warm: load speed from the page cache (GB/s)")
    parser.add_argument("--disk-gbps", type=float, default=1.3, help="--warm: load and read speed from disk (GB/s)")
    parser.add_argument("--swap-hold-s", type=float, default=None,
                        help="the proxy's swap_hold_s (default: its own, 1 s; 0: off)")
    parser.add_argument("--suspend", action="store_true",
                        help="suspend/restore (cuda_suspend) against unload/reload, simulated")
    parser.add_argument("--recent", action="store_true",
                        help="the reset's render through the proxy: ComfyUI was active just before the swap")
    args = parser.parse_args()
    if args.swap_hold_s is not None:
        PROXY["swap_hold_s"] = args.swap_hold_s
    RECENT["on"] = args.recent
    RESULTS.parent.mkdir(exist_ok=True)
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
               "proxy": PROXY, "recent": args.recent}
    if args.suspend:
        from bench.handoff_suspend import compare, table
        s = {**asyncio.run(compare(min(args.rounds, 3) if args.rounds == 10 else args.rounds)), "machine": machine}
        (RESULTS.parent / "handoff-suspend.json").write_text(json.dumps(s, indent=2))
        print(table(s))
        sys.exit(0)
    if args.wait:
        w: dict[str, Any] = {**asyncio.run(wait_for_busy(args.rounds)), "machine": machine}
        (RESULTS.parent / "handoff-wait.json").write_text(json.dumps(w, indent=2))
        print("| rounds | direct: end marker -> first byte | proxied | added median | target |")
        print("|---|---|---|---|---|")
        print(f"| {w['rounds']} | {w['direct_median_s'] * 1000:.0f} ms | {w['proxied_median_s'] * 1000:.0f} ms "
              f"| {w['added_median_ms']:.1f} ms | <= 50 ms |")
        sys.exit(0)
    if args.warm:
        r = {**asyncio.run(warm_during_release(min(args.rounds, 3) if args.rounds == 10 else args.rounds,
                                               args.ram_gbps, args.disk_gbps)), "machine": machine}
        (RESULTS.parent / "handoff-warm.json").write_text(json.dumps(r, indent=2))
        print(f"| {MODEL}, RAM {args.ram_gbps} GB/s, disk {args.disk_gbps} GB/s, ComfyUI's release "
              f"{r['release_median_s']:.2f} s | request -> first byte (median of {r['rounds']}) "
              "| file in RAM when the load started |")
        print("|---|---:|---:|")
        for mode, what in (("off", "cold file, warm-during-release off"), ("on", "cold file, warm-during-release on"),
                           ("warm", "file already in RAM (keep_warm_models)"),
                           ("wait-off", "queued behind a 10 s render, cold file, warming off (from the end marker)"),
                           ("wait-on", "queued behind a 10 s render, cold file, warmed while waiting (from the end marker)")):
            print(f"| {what} | {r[f'{mode}_median_s']:.2f} s | {100 * r[f'{mode}_resident_before_median']:.0f} % |")  # type: ignore[operator]
        sys.exit(0)
    if args.resident:
        r = {**asyncio.run(resident(max(args.rounds, 50))), "machine": machine}
        (RESULTS.parent / "handoff-resident.json").write_text(json.dumps(r, indent=2))
        print("| GPU reader | direct TTFB median | proxied TTFB median | added | target |")
        print("|---|---|---|---|---|")
        for reader in ("simulated", "broken"):
            x = r[reader]
            print(f"| {reader} | {x['direct_median_ms']:.2f} ms | {x['proxied_median_ms']:.2f} ms "  # type: ignore[index]
                  f"| {x['added_median_ms']:.2f} ms | <= 0.5 ms |")  # type: ignore[index]
        sys.exit(0)
    result = {**asyncio.run(main(args.rounds)), "proxy": PROXY, "recent": args.recent}
    RESULTS.write_text(json.dumps(result, indent=2))
    print("| rounds | direct (engines' own) median | through proxy median | overhead median | overhead p90 | target |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['rounds']} | {result['direct_median_s'] * 1000:.0f} ms | {result['proxied_median_s'] * 1000:.0f} ms "
          f"| {result['overhead_median_ms']:.1f} ms | {result['overhead_p90_ms']:.1f} ms | <= 50 ms |")
