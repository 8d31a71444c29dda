"""Model files that could freeze, leak or exhaust the proxy (issue 25), planted on the simulated box:
a FIFO, a link to a file outside, a device, a sparse file, a flood of unknown names. Each time the
proxy keeps answering `/api/stats` and GPU requests within a bound, names what it skipped, and
(the FIFO, the case that kept it alive) stops promptly on SIGTERM. The bounds only turn a hang into
a failure; nothing here measures speed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.admin.models_api import ModelsExtension
from proxy.demo import Demo, comfy_prompt
from proxy.sim.box import fast_scenario
from tests.integration.boxes import DemoFactory, proxy_of

STATS_S = 3.0  # /api/stats answers within this while the model files are attacked
GPU_S = 10.0  # a GPU request (a load through the planner) within this
STOP_S = 10.0  # SIGTERM to exit
ROOT = Path(__file__).resolve().parents[2]


def models_of(demo: Demo) -> ModelsExtension:
    assert demo.proxy is not None
    return next(e for e in proxy_of(demo).extensions if isinstance(e, ModelsExtension))


def checkpoints(demo: Demo) -> Path:
    assert demo.box.files is not None
    return demo.box.files.comfy_base / "models" / "checkpoints"


def plant_fifo(demo: Demo) -> str:
    os.mkfifo(checkpoints(demo) / "trap.safetensors")
    return "trap.safetensors"


def plant_link_outside(demo: Demo) -> str:
    assert demo.box.files is not None
    secret = demo.box.files.root / "outside"
    secret.mkdir()
    (secret / "shadow").write_text("root:$6$secret:19000::::::\n")
    os.symlink(secret / "shadow", checkpoints(demo) / "leak.safetensors")
    return "leak.safetensors"


def plant_device(demo: Demo) -> str:
    if os.geteuid() != 0:
        pytest.skip("mknod of a device node needs root (CI runs as root)")
    os.mknod(checkpoints(demo) / "zero.safetensors", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    return "zero.safetensors"


def plant_sparse(demo: Demo) -> str:
    with open(checkpoints(demo) / "sparse.safetensors", "wb") as f:
        f.truncate(100 * 10**9)  # 100 GB of holes
    return "sparse.safetensors"


async def still_answering(http: httpx.AsyncClient, demo: Demo) -> None:
    assert demo.proxy is not None
    started = time.monotonic()
    r = await asyncio.wait_for(http.get(proxy_of(demo).url("admin") + "/api/stats"), STATS_S)
    assert r.status_code == 200, f"/api/stats answered {r.status_code}"
    r = await asyncio.wait_for(http.post(proxy_of(demo).url("ollama") + "/api/generate",
                                         json={"model": "llama3.1:8b", "prompt": "hi", "stream": False}), GPU_S)
    assert r.status_code == 200, f"a GPU request answered {r.status_code}: {r.text[:200]}"
    assert time.monotonic() - started < STATS_S + GPU_S


async def attack(http: httpx.AsyncClient, demo: Demo, name: str) -> list[int]:
    """What anyone who reaches the proxy can do: list the models (the dashboard's poll, no token),
    warm one, and run ComfyUI prompts naming the file."""
    assert demo.proxy is not None
    admin, comfy = proxy_of(demo).url("admin"), proxy_of(demo).url("comfyui")
    calls = [http.get(admin + "/api/models") for _ in range(8)]
    calls += [http.post(comfy + "/prompt", json={"prompt": comfy_prompt(name)}) for _ in range(6)]
    calls.append(http.post(admin + "/api/models/warm", json={"tenant": "comfyui", "model": name}))
    answers = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), GPU_S)
    return [a.status_code if isinstance(a, httpx.Response) else -1 for a in answers]


@pytest.mark.parametrize("plant, reason", [(plant_fifo, "a FIFO"), (plant_link_outside, "outside"),
                                           (plant_device, "a character device")],
                         ids=["fifo", "link-outside", "device"])
async def test_a_file_that_is_not_a_regular_one_inside_is_skipped_and_the_proxy_keeps_answering(
        box: DemoFactory, http: httpx.AsyncClient, plant: Callable[[Demo], str], reason: str) -> None:
    demo = await box(fast_scenario("default"))
    assert demo.proxy is not None
    name = plant(demo)
    ext = models_of(demo)
    await ext.files(ext.catalog.all_files, True)  # what the next walk (at most LOCATE_TTL_S later) sees
    statuses = await attack(http, demo, name)
    assert -1 not in statuses, f"a request got no answer: {statuses}"
    await still_answering(http, demo)
    listing = (await http.get(proxy_of(demo).url("admin") + "/api/models?tenant=comfyui")).json()
    (comfy,) = listing["tenants"]
    assert name not in {m["name"] for m in comfy["models"]}, "it must not be listed (its name, its size)"
    assert any(k["path"].endswith(name) and reason in k["reason"] for k in comfy["skipped"]), comfy["skipped"]
    health = {e["name"]: e for e in (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()["entries"]}
    entry = health["model files comfyui skipped"]
    assert entry["status"] == "degraded" and name in entry["problem"] and reason in entry["problem"], entry
    assert all(j.read_bytes == 0 for k, j in ext.warmer.jobs.items() if name in k), "nothing of it was read"


async def test_hyperswap_check_names_what_was_skipped_and_why(box: DemoFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.admin.health import check_main
    demo = await box(fast_scenario("default"))
    assert demo.proxy is not None
    plant_fifo(demo)
    plant_link_outside(demo)
    ext = models_of(demo)
    await ext.files(ext.catalog.all_files, True)
    assert await asyncio.to_thread(check_main, None, proxy_of(demo).url("admin"), False) == 0  # degraded, not failed
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "model files comfyui skipped" in x)
    assert "trap.safetensors: a FIFO" in line and "leak.safetensors: a link to" in line and "outside" in line, out


async def test_a_sparse_file_is_warmed_only_as_far_as_it_occupies_the_disk(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast_scenario("default"))
    name = plant_sparse(demo)
    ext = models_of(demo)
    await ext.files(ext.catalog.all_files, True)
    statuses = await attack(http, demo, name)
    assert -1 not in statuses, statuses
    await still_answering(http, demo)
    await asyncio.wait_for(ext.settled(), GPU_S)
    job = ext.warmer.jobs[f"comfyui:{name}"]
    allocated = os.stat(checkpoints(demo) / name).st_blocks * 512
    assert job.state == "done" and job.read_bytes <= allocated, (job, allocated)


async def test_a_flood_of_unknown_model_names_walks_the_folders_at_most_once(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast_scenario("default"))
    assert demo.proxy is not None
    ck = checkpoints(demo)
    for i in range(3000):
        (ck / f"lora-{i:05}.safetensors").touch()
    ext = models_of(demo)
    await ext.files(ext.catalog.all_files, True)
    walks = ext.catalog.walks
    comfy = proxy_of(demo).url("comfyui")
    flood = [http.post(comfy + "/prompt", json={"prompt": comfy_prompt(f"nope-{i}.safetensors")}) for i in range(60)]
    flood += [http.post(proxy_of(demo).url("admin") + "/api/models/warm", json={"tenant": "comfyui", "model": f"x{i}"})
              for i in range(20)]
    answers = await asyncio.wait_for(asyncio.gather(*flood, return_exceptions=True), GPU_S)
    assert all(isinstance(a, httpx.Response) for a in answers), answers
    await still_answering(http, demo)
    assert ext.catalog.walks - walks <= 1, f"{ext.catalog.walks - walks} walks for 80 unknown names"


CHILD = """
import asyncio, os, signal, sys
sys.path.insert(0, {root!r})
from proxy.demo import start_demo
from proxy.admin.models_api import ModelsExtension
from proxy.sim.box import fast_scenario

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    demo = await start_demo(fast_scenario("default"), sim_ports={{"ollama": 0, "comfyui": 0}},
                            proxy_ports={{"ollama": 0, "comfyui": 0, "admin": 0}}, watchdog=False)
    try:
        os.mkfifo(demo.box.files.comfy_base / "models" / "checkpoints" / "trap.safetensors")
        ext = next(e for e in demo.proxy.extensions if isinstance(e, ModelsExtension))
        await asyncio.to_thread(ext.catalog.all_files, True)
        print(demo.proxy.url("admin"), demo.proxy.url("ollama"), demo.proxy.url("comfyui"), flush=True)
        await stop.wait()
    finally:
        await demo.stop()
    print("stopped", flush=True)

asyncio.run(main())  # as `hyperswap serve`: asyncio.run joins its default pool's threads on the way out
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mkfifo and SIGTERM as on the servers")
async def test_with_a_fifo_among_the_models_the_proxy_answers_and_stops_promptly_on_sigterm(http: httpx.AsyncClient) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD.format(root=str(ROOT)), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        admin, ollama, comfy = line.decode().split()
        calls: list[Any] = [http.get(admin + "/api/models") for _ in range(8)]
        calls += [http.post(comfy + "/prompt", json={"prompt": comfy_prompt("trap.safetensors")}) for _ in range(6)]
        answers = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), GPU_S)
        assert all(isinstance(a, httpx.Response) for a in answers), answers
        r = await asyncio.wait_for(http.get(admin + "/api/stats"), STATS_S)
        assert r.status_code == 200
        r = await asyncio.wait_for(http.post(ollama + "/api/generate", json={"model": "llama3.1:8b", "prompt": "hi",
                                                                               "stream": False}), GPU_S)
        assert r.status_code == 200
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(child.communicate(), STOP_S)
        took = time.monotonic() - started
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 0 and b"stopped" in out, (child.returncode, err.decode()[-2000:])
    assert took < STOP_S, f"SIGTERM took {took:.1f} s"
