"""A long prompt on a real ComfyUI through the proxy: busy from its first second to its end, health ok.

Not a test (CI never runs it): it needs a real ComfyUI. Checks issue 27's "Done when": against a real
ComfyUI on the CPU, a 45 s prompt through the proxy stays busy to its end and health stays ok (no
advice to clear a queue entry that is a working job).

Setup (once; ComfyUI in its own virtual environment, outside this repository):

    git clone https://github.com/comfyanonymous/ComfyUI /tmp/comfyui    # 0.8.0 was measured
    python3 -m venv /tmp/comfy-venv
    /tmp/comfy-venv/bin/pip install torch==2.13.0 torchvision==0.28.0 -r /tmp/comfyui/requirements.txt
    ln -s "$PWD/bench/comfyui_nodes/hyperswap_bench.py" /tmp/comfyui/custom_nodes/

torch and torchvision must be builds of one kind: PyPI's torchvision with a CPU-only torch (a
`+cpu` wheel) stops ComfyUI at start with "operator torchvision::nms does not exist". torchaudio has
no release for torch 2.13 on PyPI; without it ComfyUI only skips its audio nodes.
    cd /tmp/comfyui && /tmp/comfy-venv/bin/python main.py --cpu --listen 127.0.0.1 --port 8188

`bench/comfyui_nodes/hyperswap_bench.py` is a custom node that keeps a prompt running for N seconds
on the CPU (torch matmuls, with progress frames) without any model file, so nothing is downloaded.

Run (from the repository root, in the project's own virtual environment):

    .venv/bin/python bench/real_comfyui.py http://127.0.0.1:8188 [--seconds 45] [--runs http,ws]

It starts a HyperSwap proxy in this process in front of that URL (a tenants.json of its own: the
`comfyui` tenant's upstream is the URL, the shipped `ollama` tenant removed), with the GPU reader
`hyperswap serve` uses (NVML where there is one; without a GPU, the proxy runs with no reader, as
`serve` then does), and the watchdog on. Then, one run per client:

- `http`: POST /prompt through the proxy, then no further traffic through it: its only evidence
  that the prompt still runs is its own reads of ComfyUI's queue. The bench learns the end by
  reading ComfyUI's /history directly (bypassing the proxy on purpose).
- `ws`:   a websocket to /ws through the proxy first (as the web UI does), then POST /prompt
  through it; the end is the `executing` frame with no node (or `execution_success`).

Every second it samples the proxy's GET /api/tenants (the comfyui tenant's busy, busy_reason,
stale_jobs) and GET /api/health (the overall status and every entry not ok), until the prompt ends,
then for a few seconds more (how soon the proxy sees it idle). A run passes when every sample
answered before ComfyUI's own end of the prompt (its `execution_success` time) says busy, no sample
lists a stale job, and no health entry is worse than it was before the prompt (in particular no
"stale queue entries" advice). The result, with every sample, is written to
bench/results/real_comfyui-<time>.json; exit 0 when every run passed, 1 otherwise, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy import __version__
from proxy.engines.loading import load_registry
from proxy.gpu.nvml import NvmlReader
from proxy.gpu.pods import with_pods
from proxy.gpu.visibility import start_notice
from proxy.service import Proxy
from proxy.tasks import poll_until

TENANT = "comfyui"
NODE = "HyperSwapBenchBusy"
RESULTS = Path(__file__).resolve().parent / "results"
RANK = {"ok": 0, "degraded": 1, "failed": 2}  # health statuses, best first (an unknown one ranks worst)


@dataclass
class Sample:
    t: float  # seconds since the prompt was queued, when the answers came back
    wall: float  # time.time() then
    busy: bool | None
    busy_reason: str | None
    stale_jobs: list[str]
    health: str | None
    not_ok: dict[str, str]  # health entry -> "status: problem"
    during: bool = False  # answered before ComfyUI ended the prompt


@dataclass
class Run:
    client: str
    prompt_id: str = ""
    queued_wall: float = 0.0
    comfy_start_wall: float | None = None  # ComfyUI's own execution_start / execution_success times
    comfy_end_wall: float | None = None
    status: str | None = None  # ComfyUI's status_str
    node_says: str | None = None
    health_before: dict[str, str] = field(default_factory=dict)
    health_status_before: str | None = None
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float | None:
        if self.comfy_start_wall is None or self.comfy_end_wall is None:
            return None
        return self.comfy_end_wall - self.comfy_start_wall

    def verdict(self) -> dict[str, Any]:
        during = [s for s in self.samples if s.during]
        idle = [s for s in during if not s.busy]
        stale = [s for s in self.samples if s.stale_jobs]
        worse = [(s, name) for s in self.samples for name, text in s.not_ok.items()
                 if RANK.get(text.split(":", 1)[0], 9) > RANK.get(self.health_before.get(name, "ok: ").split(":", 1)[0], 9)]
        advice = [s for s in self.samples if any("stale queue" in n for n in s.not_ok)]
        after = [s for s in self.samples if not s.during and self.comfy_end_wall is not None]
        idle_after = next((s for s in after if s.busy is False), None)
        busy_all_along = bool(during) and not idle
        health_ok = not worse and not advice
        return {
            "passed": busy_all_along and health_ok and not stale and not self.problems and self.status == "success",
            "busy_all_along": busy_all_along,
            "samples_during": len(during),
            "first_idle_s": round(idle[0].t, 2) if idle else None,
            "first_idle_reason": idle[0].busy_reason if idle else None,
            "stale_jobs_seen": bool(stale),
            "health_ok": health_ok,
            "health_before": self.health_status_before,
            "health_statuses_during": sorted({str(s.health) for s in during}),
            "health_entries_worse": {name: s.not_ok[name] for s, name in reversed(worse)},  # the first text of each
            "idle_after_end_s": None if idle_after is None or self.comfy_end_wall is None
            else round(idle_after.wall - self.comfy_end_wall, 2),
            "prompt_duration_s": None if self.duration_s is None else round(self.duration_s, 2),
            "comfyui_status": self.status,
            "problems": self.problems,
        }


def tenants_json(upstream: str) -> dict[str, Any]:
    return {
        "admin": {"listen": "127.0.0.1:11400"},  # ports: bound as 0 below, read back
        "tenants": {
            "ollama": None,  # the shipped Ollama tenant: not part of this bench
            TENANT: {"upstream": upstream, "listen": "127.0.0.1:8189"},
        },
    }


def graph(seconds: float, mode: str) -> dict[str, Any]:
    return {"1": {"class_type": NODE, "inputs": {"seconds": seconds, "mode": mode, "seed": random.randrange(2**31)}}}


async def sample(admin: httpx.AsyncClient, queued: float) -> Sample:
    tenants, health = await asyncio.gather(admin.get("/api/tenants"), admin.get("/api/health"))
    wall = time.time()
    row: dict[str, Any] = next((t for t in tenants.json()["tenants"] if t.get("name") == TENANT), {})
    body = health.json()
    not_ok = {e["name"]: f"{e['status']}: {e.get('problem')}" for e in body.get("entries", []) if e.get("status") != "ok"}
    return Sample(round(wall - queued, 3), wall, row.get("busy"), row.get("busy_reason"), list(row.get("stale_jobs") or []),
                  body.get("status"), not_ok)


async def health_now(admin: httpx.AsyncClient) -> tuple[str | None, dict[str, str]]:
    body = (await admin.get("/api/health")).json()
    return body.get("status"), {e["name"]: f"{e['status']}: {e.get('problem')}" for e in body.get("entries", [])
                                if e.get("status") != "ok"}


async def comfy_times(direct: httpx.AsyncClient, prompt_id: str) -> dict[str, Any] | None:
    """ComfyUI's own record of the prompt (read directly, never through the proxy), once it ended."""
    r = await direct.get(f"/history/{prompt_id}")
    entry = r.json().get(prompt_id) if r.status_code == 200 else None
    return entry or None  # ComfyUI lists a prompt in its history once it has ended


def record_end(run: Run, entry: dict[str, Any]) -> None:
    status = entry.get("status", {})
    run.status = status.get("status_str")
    for kind, data in status.get("messages", []):
        if kind == "execution_start":
            run.comfy_start_wall = data["timestamp"] / 1000
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            run.comfy_end_wall = data["timestamp"] / 1000
    texts = [t for out in entry.get("outputs", {}).values() for t in out.get("text", [])]
    run.node_says = texts[0] if texts else None


async def one_run(client: str, proxy: Proxy, direct: httpx.AsyncClient, args: argparse.Namespace) -> Run:
    run = Run(client)
    comfy_url = proxy.url(TENANT)
    async with httpx.AsyncClient(base_url=proxy.url("admin"), timeout=10) as admin, \
            httpx.AsyncClient(base_url=comfy_url, timeout=30) as through:
        run.health_status_before, run.health_before = await health_now(admin)
        client_id = uuid.uuid4().hex
        ws = None
        if client == "ws":
            ws = await websockets.connect(comfy_url.replace("http://", "ws://", 1) + f"/ws?clientId={client_id}",
                                          max_size=None)
        try:
            run.queued_wall = time.time()
            r = await through.post("/prompt", json={"prompt": graph(args.seconds, args.mode), "client_id": client_id})
            if r.status_code != 200:
                run.problems.append(f"POST /prompt through the proxy answered {r.status_code}: {r.text[:300]}")
                return run
            run.prompt_id = r.json()["prompt_id"]
            ended = asyncio.Event()

            async def watch_ws() -> None:
                assert ws is not None
                async for frame in ws:
                    if not isinstance(frame, str):
                        continue  # previews
                    msg = json.loads(frame)
                    data = msg.get("data") or {}
                    if data.get("prompt_id") != run.prompt_id:
                        continue
                    if msg.get("type") in ("execution_success", "execution_error", "execution_interrupted") or \
                            (msg.get("type") == "executing" and data.get("node") is None):
                        ended.set()
                        return

            async def watch_history() -> None:
                await poll_until(lambda: comfy_times(direct, run.prompt_id), 0.25)
                ended.set()

            watcher = asyncio.create_task(watch_ws() if ws is not None else watch_history())
            deadline = time.monotonic() + args.seconds * 3 + 60
            next_at = time.monotonic() + 1.0
            while not ended.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), max(0.0, next_at - time.monotonic()))
                if ended.is_set():
                    break
                run.samples.append(await sample(admin, run.queued_wall))
                next_at += 1.0
                if time.monotonic() > deadline:
                    run.problems.append(f"the prompt did not end within {args.seconds * 3 + 60:.0f} s")
                    break
                if watcher.done() and watcher.exception() is not None:
                    run.problems.append(f"watching the prompt failed: {watcher.exception()!r}")
                    break
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            entry = None
            for _ in range(40):  # ComfyUI writes its history just after the last frame
                entry = await comfy_times(direct, run.prompt_id)
                if entry is not None:
                    break
                await asyncio.sleep(0.25)
            if entry is None:
                run.problems.append("ComfyUI's /history has no end for the prompt")
            else:
                record_end(run, entry)
            for _ in range(args.after):  # how soon the proxy sees the tenant idle again
                run.samples.append(await sample(admin, run.queued_wall))
                if run.samples[-1].busy is False:
                    break
                await asyncio.sleep(1.0)
        finally:
            if ws is not None:
                await ws.close()
    for s in run.samples:
        s.during = run.comfy_end_wall is not None and s.wall < run.comfy_end_wall
    return run


async def main_async(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    async with httpx.AsyncClient(base_url=url, timeout=10) as direct:
        try:
            stats = (await direct.get("/system_stats")).json()
            info = (await direct.get(f"/object_info/{NODE}")).json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"cannot reach ComfyUI at {url}: {exc}", file=sys.stderr)
            return 2
        if NODE not in info:
            print(f"ComfyUI at {url} has no {NODE} node: link bench/comfyui_nodes/hyperswap_bench.py into its "
                  "custom_nodes/ and restart it", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="hyperswap-realcomfy-") as tmp:
            config = Path(tmp) / "tenants.json"
            config.write_text(json.dumps(tenants_json(url), indent=2))
            registry = load_registry(config)
            proxy = Proxy(registry, with_pods(NvmlReader()), config_path=config, lifecycle_dir=Path(tmp) / "lifecycle")
            await proxy.start({"admin": 0, TENANT: 0})
            try:
                await proxy.broker.snapshot()
                notice = start_notice(proxy.broker.last_snapshot, proxy.broker.last_read_error)
                await asyncio.sleep(2.5)  # a few watchdog ticks: the engine has said it runs on the CPU
                runs = []
                for client in args.runs:
                    print(f"{client}: a {args.seconds:g} s prompt ({args.mode}) through {proxy.url(TENANT)} ...",
                          file=sys.stderr, flush=True)
                    run = await one_run(client, proxy, direct, args)
                    runs.append(run)
                    v = run.verdict()
                    print(f"{client}: {'PASS' if v['passed'] else 'FAIL'} busy all along {v['busy_all_along']} "
                          f"({v['samples_during']} samples; first idle at {v['first_idle_s']} s: {v['first_idle_reason']}), "
                          f"health no worse than before {v['health_ok']} (overall {v['health_before']} before, "
                          f"{v['health_statuses_during']} during; not ok before: {sorted(run.health_before)}), "
                          f"prompt {v['prompt_duration_s']} s, idle {v['idle_after_end_s']} s after its end"
                          + (f"; worse: {v['health_entries_worse']}" if v["health_entries_worse"] else "")
                          + (f"; problems: {v['problems']}" if v["problems"] else ""), file=sys.stderr, flush=True)
                on_cpu = TENANT in getattr(proxy.broker, "cpu_tenants", ())  # (older proxies: none)
            finally:
                await proxy.stop()
    system = stats.get("system", {})
    result = {
        "bench": "real_comfyui",
        "hyperswap": __version__,
        "comfyui": {"url": url, "version": system.get("comfyui_version"), "pytorch": system.get("pytorch_version"),
                    "argv": system.get("argv"), "devices": [d.get("type") for d in stats.get("devices", [])]},
        "gpu_reader": notice or "NVML",
        "proxy_saw_cpu_engine": on_cpu,
        "seconds": args.seconds,
        "mode": args.mode,
        "machine": {"nproc": os.cpu_count(), "arch": platform.machine()},
        "passed": all(r.verdict()["passed"] for r in runs),
        "runs": [{"client": r.client, "prompt_id": r.prompt_id, "verdict": r.verdict(), "node_says": r.node_says,
                  "health_before": r.health_before, "samples": [asdict(s) for s in r.samples]} for r in runs],
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"real_comfyui-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"{'PASS' if result['passed'] else 'FAIL'}: {out}", file=sys.stderr)
    return 0 if result["passed"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("url", help="the real ComfyUI, e.g. http://127.0.0.1:8188 (with bench/comfyui_nodes linked in)")
    p.add_argument("--seconds", type=float, default=45.0, help="how long the prompt runs (default 45)")
    p.add_argument("--mode", choices=("compute", "sleep"), default="compute", help="the node computes or sleeps")
    p.add_argument("--runs", default="http,ws", help="clients, in order: http, ws or both (default http,ws)")
    p.add_argument("--after", type=int, default=10, help="samples after the end, until idle (default 10)")
    args = p.parse_args()
    args.runs = [c.strip() for c in args.runs.split(",") if c.strip()]
    if not args.runs or any(c not in ("http", "ws") for c in args.runs):
        p.error("--runs: http, ws or both, comma-separated")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
