"""A handoff by CUDA suspension (release kind cuda_suspend) against one by unload and reload, on the
simulated box: SIMULATED figures, from the simulators' configured rates (the scenario `suspend`: a
12 GB/s host copy, a 4 GB/s checkpoint load from the page cache, Ollama's 2 GB/s), never a card's.

Run through `python bench/handoff.py --suspend [--rounds N]`. Each round, on a 16 GiB card: a
render (ComfyUI holds SDXL, 6.9 GiB), a chat (qwen2.5:14b, 9 GiB: ComfyUI must give the card up),
then the render that is timed, from its websocket's connect (which wakes ComfyUI) to its end
marker: the handoff back to ComfyUI plus a 4-step render.
- suspend: both tenants' release lists start with cuda_suspend: Ollama is parked in host RAM and
  ComfyUI restored, its checkpoint still loaded;
- unload:  the shipped release kinds: Ollama unloads (keep_alive 0), ComfyUI's checkpoint is read
  again (POST /free released it).
For suspend, `restore_vs_rate` is the restore's own time over bytes / copy rate (1.0: exactly the
copy), and `handoff_vs_rate` the whole handoff (Ollama parked + ComfyUI restored + the render) over
the bytes both copies move / the rate: the issue's bound is 1.5.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import httpx
from websockets.asyncio.client import connect as ws_connect

from proxy.config.units import GIB
from proxy.demo import Demo, comfy_prompt, run_prompt, start_demo
from proxy.sim.box import Scenario, load_scenario

CKPT = "sd_xl_base_1.0.safetensors"
CHAT = "qwen2.5:14b"


def scenario(mode: str) -> Scenario:
    data = load_scenario("suspend").model_dump()
    data["ollama"].update({"token_rate": 2000.0})
    data["comfyui"].update({"step_time_s": 0.005})
    if mode == "unload":
        data["tenants"] = {"comfyui": {"release": {"kind": "comfyui_free"}},
                           "ollama": {"release": {"kind": "ollama_unload"}}}
    return Scenario.model_validate(data)


async def timed_render(base: str, client: httpx.AsyncClient) -> float:
    """Seconds from the websocket's connect (the wake) to the prompt's end marker."""
    cid = uuid.uuid4().hex
    start = time.perf_counter()
    async with ws_connect(base.replace("http://", "ws://") + f"/ws?clientId={cid}", max_size=None) as ws:
        await ws.recv()
        r = await client.post(base + "/prompt", json={"prompt": comfy_prompt(CKPT), "client_id": cid})
        r.raise_for_status()
        pid = r.json()["prompt_id"]
        async with asyncio.timeout(120):
            while True:
                raw = await ws.recv()
                if isinstance(raw, str) and '"executing"' in raw and '"node": null' in raw and pid in raw:
                    return time.perf_counter() - start


def _facts(demo: Demo) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(what each suspend of Ollama parked, what each restore of ComfyUI brought back), oldest first."""
    assert demo.proxy is not None
    parked, restored = [], []
    for d in reversed(demo.proxy.decisions.recent(500)):
        outcome: dict[str, Any] = d.outcome
        asked = outcome.get("asked")
        if d.kind == "resume" and d.tenant == "comfyui" and isinstance(asked, dict) and asked.get("restored"):
            restored.append(asked)
        for r in outcome.get("releases", []) if d.kind == "plan" else []:
            if r["tenant"] == "ollama" and isinstance(r.get("asked"), dict) and "suspended" in r["asked"]:
                parked.append(r["asked"])
    return parked, restored


async def one_mode(mode: str, rounds: int) -> dict[str, Any]:
    demo = await start_demo(scenario(mode), sim_ports={"ollama": 0, "comfyui": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0}, watchdog=False)
    assert demo.proxy is not None and demo.box.comfyui is not None
    comfy, ollama = demo.proxy.url("comfyui"), demo.proxy.url("ollama")
    rate = demo.box.checkpointer.copy_gbps * 1e9
    handoffs: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            await run_prompt(comfy, CKPT, client, 120)
            for _ in range(rounds):
                r = await client.post(ollama + "/api/generate", json={"model": CHAT, "prompt": "hi", "stream": False})
                r.raise_for_status()
                handoffs.append(await timed_render(comfy, client))
        out: dict[str, Any] = {"mode": mode, "rounds": rounds, "handoff_median_s": round(statistics.median(handoffs), 3),
                               "checkpoint_loads": demo.box.comfyui.checkpoint_loads}
        if mode == "suspend":
            parked, restored = _facts(demo)
            times = [a["duration_s"] for a in restored]
            moved = [p["parked_bytes"] + a["bytes"] for p, a in zip(parked, restored, strict=True)]
            out.update({"copy_gbps": rate / 1e9, "restore_median_s": round(statistics.median(times), 3),
                        "restore_gib": round(statistics.median(a["bytes"] for a in restored) / GIB, 2),
                        "restore_vs_rate": round(statistics.median(a["duration_s"] / (a["bytes"] / rate)
                                                                   for a in restored), 2),
                        "handoff_vs_rate": round(statistics.median(h / (m / rate) for h, m in zip(handoffs, moved,
                                                                                                   strict=True)), 2)})
    finally:
        await demo.stop()
    return out


async def compare(rounds: int) -> dict[str, Any]:
    """Both modes, one after the other (each on its own box)."""
    return {"simulated": True, "suspend": await one_mode("suspend", rounds), "unload": await one_mode("unload", rounds)}


def table(r: dict[str, Any]) -> str:
    s, u = r["suspend"], r["unload"]
    lines = ["SIMULATED (the demo's configured rates, not a card's)",
             "| handoff back to ComfyUI (SDXL) after a chat | request -> render done, median | checkpoint reads |",
             "|---|---:|---:|",
             f"| suspend/restore ({s['restore_gib']} GiB restored at {s['copy_gbps']:g} GB/s) "
             f"| {s['handoff_median_s']:.2f} s | {s['checkpoint_loads']} |",
             f"| unload/reload | {u['handoff_median_s']:.2f} s | {u['checkpoint_loads']} |",
             "",
             f"restore: {s['restore_median_s']:.3f} s = {s['restore_vs_rate']}x bytes / rate; whole handoff "
             f"{s['handoff_vs_rate']}x the bytes both copies move / rate (bound: 1.5x)"]
    return "\n".join(lines)
