"""`hyperswap demo`: the proxy in front of a simulated GPU, Ollama and ComfyUI, on loopback.

`--check` runs a short self-test of every simulator route and one handoff through the proxy, prints
the result and exits 0/1. Without it the demo runs until Ctrl-C and then stops everything it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
import wave
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx
from websockets.asyncio.client import connect as ws_connect

from proxy.admin.telemetry import ENV_VAR as ENV_TELEMETRY
from proxy.admin.telemetry import Telemetry, completes
from proxy.clock import Clock, SystemClock
from proxy.config.loading import load_registry_over, registry_from_dict
from proxy.config.units import GIB
from proxy.decision import DecisionEvent
from proxy.gpu.keeper import GpuDrift
from proxy.handoff.decisions import DecisionView, LifecycleExit, ModelLoad
from proxy.relay.servers import settle_heap
from proxy.service import Proxy
from proxy.sim.box import Scenario, SimBox, fast_scenario, load_scenario
from proxy.sim.box import scenario_names as scenario_names  # for `demo --help` (cli.py never imports proxy.sim)
from proxy.tasks import poll_until
from proxy.tls import client_context

DEFAULT_SIM_PORTS = {"ollama": 21434, "comfyui": 28188}  # "relay": the scenario's relay.port unless given
EXAMPLE_CKPT = "sd_xl_base_1.0.safetensors"  # examples/comfy_prompt.json's


@dataclass(slots=True)
class Demo:
    box: SimBox
    proxy: Proxy | None
    config: Path | None = None  # the tenants.json applied over the scenario (--config)
    workdir: Path | None = field(default=None)  # the files the "Try:" lines name; removed on stop

    @property
    def urls(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.proxy and "admin" in self.proxy.servers:  # first: what the README says to open
            out["dashboard (admin API)"] = self.proxy.servers["admin"].url
        out.update({f"{name} simulator": s.url for name, s in self.box.servers.items()})
        if self.proxy:
            out.update({f"{name} via proxy": s.url for name, s in self.proxy.servers.items() if name != "admin"})
        return out

    async def stop(self) -> None:
        try:
            if self.proxy:
                await self.proxy.stop()
            await self.box.stop()
        finally:
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _workdir(self) -> Path:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="hyperswap-demo-"))
        return self.workdir

    def sample_wav(self) -> Path:
        """A quarter second of silence (16 kHz mono WAV), for the speech relay's Try line: a file
        everyone has, written once to the demo's own folder."""
        path = self._workdir() / "sample.wav"
        if not path.exists():
            with wave.open(str(path), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(16000)
                w.writeframes(bytes(2 * 4000))
        return path

    def example_prompt(self) -> Path:
        """A ComfyUI graph for this box's checkpoints, written once to a file of the demo's own (an
        absolute path: the "Try:" line works from any folder, and from an installed wheel)."""
        path = self._workdir() / "comfy_prompt.json"
        if not path.exists():
            ckpts = self.box.comfyui.config.checkpoints if self.box.comfyui else {}
            ckpt = EXAMPLE_CKPT if EXAMPLE_CKPT in ckpts else max(ckpts, key=lambda k: ckpts[k], default=EXAMPLE_CKPT)
            path.write_text(json.dumps({"prompt": comfy_prompt(ckpt, seed=42)}, indent=1) + "\n")
        return path


async def start_demo(scenario: str | Scenario = "default", *, sim_ports: Mapping[str, int] | None = None,
                     proxy_ports: Mapping[str, int] | None = None, with_proxy: bool = True,
                     watchdog: bool = True, clock: Clock | None = None, config: str | os.PathLike[str] | None = None,
                     scenario_name: str | None = None) -> Demo:
    """The simulated box and the proxy in front of it, all on one clock (the system's unless given:
    tests give a ticking ManualClock to jump past the proxy's thresholds). `config`: a tenants.json
    whose settings apply over the scenario's (the simulated engines' upstreams stay the simulators')."""
    clock = clock or SystemClock()
    name = scenario_name or (scenario if isinstance(scenario, str) else "custom")
    box = SimBox(load_scenario(scenario) if isinstance(scenario, str) else scenario, clock)
    ports = {**DEFAULT_SIM_PORTS, **(sim_ports or {})}
    await box.start(ollama_port=ports["ollama"], comfyui_port=ports["comfyui"], relay_port=ports.get("relay"))
    proxy = None
    path = _absolute(config)
    workdir = Path(tempfile.mkdtemp(prefix="hyperswap-demo-"))
    if with_proxy:
        try:
            # The demo never reads the operator's tenants.json unless --config names one: shipped
            # defaults, the scenario, then that file.
            overrides = {**box.tenant_overrides(), **_own_history(workdir)}
            if path is None:
                registry = registry_from_dict(overrides)
                note = f"demo scenario {name!r} over the shipped defaults (no tenants.json read)"
            else:
                pinned = {n: {"upstream": s.url} for n, s in box.servers.items()}
                if box.scenario.relay is not None and box.relay_port is not None:  # the lifecycle scenario's relay
                    pinned[box.scenario.relay.tenant] = {"upstream": box.relay_tenant()["upstream"]}
                registry = load_registry_over(overrides, path, pinned)
                note = (f"demo scenario {name!r} with {path} applied over it (the simulated "
                        f"{' and '.join(pinned) or 'engines'} keep their simulators as upstream)")
            proxy = Proxy(registry, box.gpu, clock, watchdog_enabled=watchdog, config_note=note)
            await proxy.start(proxy_ports)
        except BaseException:
            await box.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    return Demo(box, proxy, path, workdir)


def _own_history(workdir: Path) -> dict[str, Any]:
    """Each demo run keeps its history (the telemetry the dashboard's charts and decision ids come
    from) in a file of its own, in its own folder, removed when it stops: a new run never shows an
    earlier run's decisions or VRAM. Only $HYPERSWAP_TELEMETRY (or --config's `telemetry.path`,
    which applies over this) names another file."""
    if ENV_TELEMETRY in os.environ:
        return {}
    return {"telemetry": {"path": str(workdir / "telemetry.sqlite3")}}


def _absolute(config: str | os.PathLike[str] | None) -> Path | None:
    """The --config path as health and the banner name it: absolute, whatever folder the demo ran in."""
    return None if config is None else Path(os.path.abspath(config))


def describe(demo: Demo, scenario: str) -> str:
    lines = [f"hyperswap demo: scenario {scenario!r} ({demo.box.scenario.description})", *_cards(demo)]
    if demo.config is not None:
        lines.append(f"configuration: {demo.config} applied over the scenario (its proxy, admin and telemetry "
                     "settings and tenants; the simulated engines keep their simulators as upstream)")
    if demo.proxy:
        lines.append(_history_line(demo))
    lines.append("")
    for what, url in demo.urls.items():
        lines.append(f"  {what:<22} {url}")
    if demo.proxy:
        o, c, a = demo.proxy.url("ollama"), demo.proxy.url("comfyui"), demo.proxy.url("admin")
        big = max(demo.box.ollama.config.models, key=lambda m: m.size_bytes).name if demo.box.ollama else "llama3.1:8b"
        lines += ["", "Try:",
                  f"  curl -s {c}/prompt -d @{demo.example_prompt()}      # ComfyUI loads a checkpoint",
                  f"  curl -s {o}/api/generate -d '{{\"model\":\"{big}\",\"prompt\":\"hi\",\"stream\":false}}'   "
                  + ("# Ollama needs it back" if demo.box.gpu.device_count == 1 else "# on its own GPU: nothing released"),
                  f"  curl -s {a}/api/decisions | python3 -m json.tool          # what the proxy decided and why",
                  f"  curl -s {a}/api/models | python3 -m json.tool             # model files: size, how much is in RAM"]
        relay = demo.box.scenario.relay
        if relay is not None and relay.tenant in demo.proxy.servers:
            r = demo.proxy.url(relay.tenant)
            lines += [f"  curl -si {r}/health                     # a read: 503 while it is stopped, never starts it",
                      f"  curl -s {r}/v1/audio/transcriptions -H 'Content-Type: audio/wav' --data-binary "
                      f"@{demo.sample_wav()}   # starts the speech relay ({relay.vram_gb:g} GiB); a render that "
                      "needs it stops it"]
    lines += ["", "Ctrl-C stops everything."]
    return "\n".join(lines)


def _history_line(demo: Demo) -> str:
    assert demo.proxy
    tel = next((e for e in demo.proxy.extensions if isinstance(e, Telemetry)), None)
    if tel is None or tel.path is None:
        return "history: none kept (telemetry off)"
    if demo.workdir is not None and tel.path.parent == demo.workdir:
        return f"history: this run's own, in {tel.path} (removed at Ctrl-C; no earlier run's decisions or charts)"
    return f"history: {tel.path} (named by {ENV_TELEMETRY} or --config: kept across runs, earlier runs' rows included)"


def _cards(demo: Demo) -> list[str]:
    g = demo.box.gpu
    if g.device_count == 1:
        return [f"simulated GPU: {g.name}, {g.total_bytes / GIB:.1f} GiB"]
    cards = [g.device(i) for i in range(g.device_count)]
    return [f"simulated GPU {c.index}: {c.name}, {c.total_bytes / GIB:.1f} GiB" for c in cards]


def _engine_card(demo: Demo, engine: Literal["ollama", "comfyui"]) -> int:
    spec = demo.box.scenario.engines.get(engine)
    return spec.gpu if spec is not None else 0


# -- the self-test ---------------------------------------------------------------------------------

Check = Callable[[], Awaitable[str]]


def comfy_prompt(ckpt: str, seed: int | None = None) -> dict[str, Any]:
    seed = seed if seed is not None else int(time.time() * 1000) % 1_000_000
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dusk", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": 4, "cfg": 7.0, "sampler_name": "euler",
                                                   "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                   "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "demo", "images": ["8", 0]}},
    }


async def run_prompt(base: str, ckpt: str, client: httpx.AsyncClient, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Queue a prompt with a websocket open and return its messages up to the end marker."""
    cid = uuid.uuid4().hex
    ws_url = base.replace("http://", "ws://") + f"/ws?clientId={cid}"
    async with ws_connect(ws_url, max_size=None, ping_interval=None) as ws:
        json.loads(await ws.recv())  # status with sid
        r = await client.post(f"{base}/prompt", json={"prompt": comfy_prompt(ckpt), "client_id": cid})
        r.raise_for_status()
        pid = r.json()["prompt_id"]
        msgs: list[dict[str, Any]] = []
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await ws.recv()
                if isinstance(raw, bytes):
                    continue
                m = json.loads(raw)
                msgs.append(m)
                if m["type"] == "executing" and m["data"].get("node") is None and m["data"].get("prompt_id") == pid:
                    return msgs


async def self_test(demo: Demo) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    async with httpx.AsyncClient(timeout=60.0, trust_env=False, verify=client_context()) as client:
        async def check(name: str, fn: Check) -> None:
            try:
                results.append((name, True, await fn()))
            except Exception as exc:  # the report says what failed, never a traceback
                results.append((name, False, f"{type(exc).__name__}: {exc}"))

        def expect(r: httpx.Response, status: int = 200) -> httpx.Response:
            if r.status_code != status:
                raise AssertionError(f"{r.request.method} {r.request.url.path} answered {r.status_code}: {r.text[:160]}")
            return r

        if demo.box.ollama:
            o = demo.box.servers["ollama"].url
            models = demo.box.ollama.config.models
            small = min(models, key=lambda m: m.size_bytes).name
            chat_model = next(m.name for m in sorted(models, key=lambda m: m.size_bytes) if "completion" in m.capabilities)
            embed_model = next((m.name for m in models if "embedding" in m.capabilities), small)

            async def o_root() -> str:
                return expect(await client.get(o + "/")).text

            async def o_version() -> str:
                return expect(await client.get(o + "/api/version")).json()["version"]

            async def o_tags() -> str:
                return f"{len(expect(await client.get(o + '/api/tags')).json()['models'])} models"

            async def o_generate() -> str:
                r = expect(await client.post(o + "/api/generate", json={"model": chat_model, "prompt": "hi"}))
                lines = [json.loads(x) for x in r.text.splitlines() if x]
                assert lines[-1]["done"] is True, lines[-1]
                return f"{len(lines)} NDJSON lines"

            async def o_chat() -> str:
                r = expect(await client.post(o + "/api/chat", json={"model": chat_model, "stream": False,
                                                                    "messages": [{"role": "user", "content": "hi"}]}))
                return r.json()["message"]["content"][:30]

            async def o_ps() -> str:
                return ", ".join(m["name"] for m in expect(await client.get(o + "/api/ps")).json()["models"])

            async def o_show() -> str:
                shown = expect(await client.post(o + "/api/show", json={"model": chat_model})).json()
                return ",".join(shown.get("capabilities", []))

            async def o_embed() -> str:
                r = expect(await client.post(o + "/api/embed", json={"model": embed_model, "input": "hi"}))
                return f"dim {len(r.json()['embeddings'][0])}"

            async def o_v1() -> str:
                r = expect(await client.post(o + "/v1/chat/completions", json={
                    "model": chat_model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}))
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-80:]
                return f"{r.text.count('data: ')} SSE events"

            async def o_models() -> str:
                return f"{len(expect(await client.get(o + '/v1/models')).json()['data'])} models"

            async def o_pull_copy_delete() -> str:
                r = expect(await client.post(o + "/api/pull", json={"model": "tinyllama:1.1b"}))
                assert json.loads(r.text.splitlines()[-1])["status"] == "success"
                expect(await client.post(o + "/api/copy", json={"source": "tinyllama:1.1b", "destination": "tiny-copy"}))
                expect(await client.request("DELETE", o + "/api/delete", json={"model": "tiny-copy"}))
                expect(await client.request("DELETE", o + "/api/delete", json={"model": "tinyllama:1.1b"}))
                return "pull, copy, delete"

            async def o_unload() -> str:
                r = expect(await client.post(o + "/api/generate", json={"model": chat_model, "keep_alive": 0}))
                return r.json()["done_reason"]

            for name, fn in [("ollama GET /", o_root), ("ollama /api/version", o_version), ("ollama /api/tags", o_tags),
                             ("ollama /api/generate", o_generate), ("ollama /api/chat", o_chat), ("ollama /api/ps", o_ps),
                             ("ollama /api/show", o_show), ("ollama /api/embed", o_embed),
                             ("ollama /v1/chat/completions", o_v1), ("ollama /v1/models", o_models),
                             ("ollama pull/copy/delete", o_pull_copy_delete), ("ollama unload", o_unload)]:
                await check(name, fn)

        if demo.box.comfyui:
            c = demo.box.servers["comfyui"].url
            ckpts = demo.box.comfyui.config.checkpoints
            small_ckpt = min(ckpts, key=lambda k: ckpts[k])

            async def c_stats() -> str:
                return expect(await client.get(c + "/system_stats")).json()["devices"][0]["name"]

            async def c_api_prefix() -> str:
                return str(expect(await client.get(c + "/api/queue")).json())

            async def c_object_info() -> str:
                return f"{len(expect(await client.get(c + '/object_info')).json())} nodes"

            async def c_features() -> str:
                return str(expect(await client.get(c + "/features")).json())

            async def c_prompt() -> str:
                msgs = await run_prompt(c, small_ckpt, client)
                types = [m["type"] for m in msgs]
                assert "execution_success" in types, types
                return f"{len(msgs)} ws messages, ends with executing null"

            async def c_history() -> str:
                return f"{len(expect(await client.get(c + '/history')).json())} entries"

            async def c_upload_view() -> str:
                files = {"image": ("demo.png", b"\x89PNG\r\n\x1a\n" + b"0" * 64, "image/png")}
                up = expect(await client.post(c + "/upload/image", files=files)).json()
                r = await client.get(c + "/view", params={"filename": up["name"], "type": "input"},
                                     headers={"Range": "bytes=0-7"})
                expect(r, 206)
                return f"uploaded {up['name']}, Range -> 206"

            async def c_free() -> str:
                expect(await client.post(c + "/free", json={"unload_models": True, "free_memory": True}))
                return "200 (memory comes back later)"

            for name, fn in [("comfyui /system_stats", c_stats), ("comfyui /api/ prefix", c_api_prefix),
                             ("comfyui /object_info", c_object_info), ("comfyui /features", c_features),
                             ("comfyui /prompt + /ws", c_prompt), ("comfyui /history", c_history),
                             ("comfyui upload + view", c_upload_view), ("comfyui /free", c_free)]:
                await check(name, fn)

        if demo.proxy and demo.box.ollama and demo.box.comfyui:
            await check("proxy: handoff ComfyUI -> Ollama", lambda: _handoff_check(demo, client))
            await check("proxy: chat during a render waits", lambda: _chat_during_render(demo, client))
            await check("proxy: prompt after a chat runs", lambda: _prompt_after_chat(demo, client))
            await check("proxy: 3 rounds chat then image", lambda: _rounds(demo, client, 3))
            await check("proxy: release after end marker", lambda: _release_after_end(demo, client))
            await check("proxy: unload needs no memory", lambda: _unload_releases_nobody(demo, client))
        if demo.proxy and demo.box.ollama and demo.box.comfyui and demo.box.gpu.device_count > 1:
            await check("proxy: one GPU's load keeps the other's", lambda: _cards_apart(demo, client))
        if demo.proxy and demo.box.ollama:
            await check("proxy: 507 names the blockers", lambda: _rejection_check(demo, client))
        if demo.proxy and demo.box.comfyui and demo.box.scenario.relay is not None:
            await check("proxy: relay stopped for a render", lambda: _relay_stopped_and_started(demo, client))
    return results


async def _unload_ollama(demo: Demo, client: httpx.AsyncClient) -> None:
    assert demo.box.ollama
    base = demo.box.servers["ollama"].url
    for m in (await client.get(base + "/api/ps")).json()["models"]:
        await client.post(base + "/api/generate", json={"model": m["name"], "keep_alive": 0})
    await demo.box.ollama.wait_until(lambda: not demo.box.ollama.loaded(), timeout_s=15)  # type: ignore[union-attr]


async def _handoff_check(demo: Demo, client: httpx.AsyncClient) -> str:
    """ComfyUI holds its largest checkpoint; an Ollama model that only fits once ComfyUI lets go."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    await _unload_ollama(demo, client)
    ckpts = demo.box.comfyui.config.checkpoints
    await run_prompt(demo.proxy.url("comfyui"), max(ckpts, key=lambda k: ckpts[k]), client)
    free = demo.box.gpu.free_bytes()
    comfy_held = demo.box.gpu.used_by(demo.box.comfyui.pid or 0)
    allowance = demo.proxy.registry.get("ollama").context_allowance_bytes
    candidates = [m for m in demo.box.ollama.config.models if "completion" in m.capabilities
                  and free < m.size_bytes + allowance <= free + comfy_held - demo.box.comfyui.config.context_floor_bytes]
    if not candidates:
        return "not applicable: no model in this scenario needs ComfyUI's memory"
    model = min(candidates, key=lambda m: m.size_bytes)
    r = await client.post(demo.proxy.url("ollama") + "/api/generate",
                          json={"model": model.name, "prompt": "hi", "stream": False})
    if r.status_code != 200:
        raise AssertionError(f"{model.name} through the proxy answered {r.status_code}: {r.text[:200]}")
    plans = [d for d in demo.proxy.decisions.recent() if d.kind == "plan" and d.tenant == "ollama"]
    assert plans, "the proxy loaded the model without a handoff"
    released = [(x["tenant"], x["freed_gb"]) for x in plans[-1].outcome.get("releases", [])]
    return f"{model.name} loaded after releasing " + ", ".join(f"{t} ({gb} GiB)" for t, gb in released)


def _swap_pair(demo: Demo) -> tuple[str, str] | None:
    """The smallest chat model and the largest checkpoint that cannot share this card: each load
    needs the other one's memory. None when every pair fits."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    if _engine_card(demo, "ollama") != _engine_card(demo, "comfyui"):
        return None  # on separate cards no load needs the other's memory
    g, comfy, reg = demo.box.gpu, demo.box.comfyui.config, demo.proxy.registry
    others = sum(int(p.vram_gb * GIB) for p in demo.box.scenario.processes)  # the desktop, unmanaged apps
    usable = g.total_bytes - g.reserved_bytes - others
    ckpt = max(comfy.checkpoints, key=lambda k: comfy.checkpoints[k])
    comfy_uses = comfy.checkpoints[ckpt] + comfy.context_floor_bytes + comfy.working_bytes  # while sampling
    allowance = reg.get("ollama").context_allowance_bytes
    fits_alone = [m for m in demo.box.ollama.config.models if "completion" in m.capabilities
                  and m.size_bytes + allowance <= usable - comfy.context_floor_bytes]
    pair = [m for m in fits_alone if m.size_bytes + comfy_uses > usable]
    return (min(pair, key=lambda m: m.size_bytes).name, ckpt) if pair else None


async def _chat(demo: Demo, client: httpx.AsyncClient, model: str) -> None:
    assert demo.proxy
    r = await client.post(demo.proxy.url("ollama") + "/api/chat",
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    if r.status_code != 200:
        raise AssertionError(f"chat with {model} answered {r.status_code}: {r.text[:200]}")


async def _render(demo: Demo, client: httpx.AsyncClient, ckpt: str) -> None:
    assert demo.proxy
    types = [m["type"] for m in await run_prompt(demo.proxy.url("comfyui"), ckpt, client, timeout_s=120)]
    if "execution_success" not in types:
        raise AssertionError(f"the prompt for {ckpt} did not succeed: {types}")


def _not_applicable(demo: Demo) -> str:
    if _engine_card(demo, "ollama") != _engine_card(demo, "comfyui"):
        return "not applicable: Ollama and ComfyUI run on separate GPUs"
    return "not applicable: every chat model and checkpoint of this scenario fit on the card together"


async def _cards_apart(demo: Demo, client: httpx.AsyncClient) -> str:
    """Several GPUs: Ollama holds its largest chat model on its card, ComfyUI then loads its largest
    checkpoint on the other: nothing of Ollama's is released, and its model stays loaded."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    o_card, c_card = _engine_card(demo, "ollama"), _engine_card(demo, "comfyui")
    if o_card == c_card:
        return "not applicable: Ollama and ComfyUI share a card"
    model = max((m for m in demo.box.ollama.config.models if "completion" in m.capabilities), key=lambda m: m.size_bytes)
    ckpts = demo.box.comfyui.config.checkpoints
    ckpt = max(ckpts, key=lambda k: ckpts[k])
    await _chat(demo, client, model.name)
    before = len(demo.proxy.decisions.recent(500))
    await _render(demo, client, ckpt)
    released = [r["tenant"] for d in demo.proxy.decisions.recent(500)[before:]
                for r in (d.outcome.get("releases") or []) if r.get("tenant") == "ollama"]
    if released:
        raise AssertionError(f"a load on GPU {c_card} released Ollama on GPU {o_card}")
    loaded = [m["name"] for m in (await client.get(demo.box.servers["ollama"].url + "/api/ps")).json()["models"]]
    if model.name not in loaded:
        raise AssertionError(f"{model.name} is no longer loaded after the render on GPU {c_card}: {loaded}")
    return f"{ckpt} rendered on GPU {c_card}; {model.name} stayed on GPU {o_card}, nothing released"


async def _chat_during_render(demo: Demo, client: httpx.AsyncClient) -> str:
    """A chat whose model needs ComfyUI's memory, sent while a prompt renders: it waits, then runs."""
    assert demo.proxy and demo.box.comfyui
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    await _unload_ollama(demo, client)
    started = time.monotonic()
    rendering = asyncio.ensure_future(_render(demo, client, ckpt))
    inflight = demo.proxy.inflight
    async with asyncio.timeout(30):
        await poll_until(lambda: inflight.traffic("comfyui").jobs, 0.01)
    await _chat(demo, client, model)
    if not rendering.done():
        raise AssertionError("the chat was answered before the render ended: the busy tenant was not waited for")
    await rendering
    queued = [d for d in demo.proxy.decisions.recent() if d.kind == "queued" and d.tenant == "ollama"]
    if not queued or queued[-1].outcome.get("result") != "admitted":
        raise AssertionError("the chat never waited in the handoff queue")
    waited = queued[-1].outcome["waited_s"]
    return f"{model} waited {waited} s for the {ckpt} render, then ran ({time.monotonic() - started:.1f} s in all)"


async def _prompt_after_chat(demo: Demo, client: httpx.AsyncClient) -> str:
    """ComfyUI asks for memory an idle Ollama holds: whatever the priorities, idle memory serves it."""
    assert demo.proxy
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    await _chat(demo, client, model)
    await _render(demo, client, ckpt)
    plan = [d for d in demo.proxy.decisions.recent() if d.kind == "plan" and d.tenant == "comfyui"]
    released = [r["tenant"] for r in plan[-1].outcome.get("releases", [])] if plan else []
    return f"{ckpt} rendered after releasing {', '.join(released) or 'nobody'}"


async def _rounds(demo: Demo, client: httpx.AsyncClient, rounds: int) -> str:
    assert demo.proxy
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    started = time.monotonic()
    before = len(demo.proxy.decisions.recent(500))
    for _ in range(rounds):
        await _chat(demo, client, model)
        await _render(demo, client, ckpt)
    bad = [d for d in demo.proxy.decisions.recent(500)[before:] if d.kind in ("rejection", "oom_retry")]
    if bad:
        raise AssertionError(f"{len(bad)} refusal(s) or OOM retries: {bad[0].to_json()}")
    return f"{rounds} x ({model} chat, {ckpt} render) in {time.monotonic() - started:.1f} s, no error"


async def _release_after_end(demo: Demo, client: httpx.AsyncClient) -> str:
    """The watchdog read ComfyUI's queue while the prompt ran; a release asked at its end marker is 200."""
    assert demo.proxy and demo.box.comfyui
    ckpts = demo.box.comfyui.config.checkpoints
    rendering = asyncio.ensure_future(_render(demo, client, min(ckpts, key=lambda k: ckpts[k])))
    inflight = demo.proxy.inflight
    async with asyncio.timeout(30):
        await poll_until(lambda: inflight.traffic("comfyui").jobs, 0.01)
    await demo.proxy.watchdog.tick()
    await rendering
    r = await client.post(demo.proxy.url("admin") + "/api/tenants/comfyui/release")
    if r.status_code != 200:
        raise AssertionError(f"release right after the end marker answered {r.status_code}: {r.text[:200]}")
    return f"200, {r.json()['freed_gb']} GiB back on the card"


async def _unload_releases_nobody(demo: Demo, client: httpx.AsyncClient) -> str:
    assert demo.proxy and demo.box.ollama
    biggest = max(demo.box.ollama.config.models, key=lambda m: m.size_bytes).name
    before = len(demo.proxy.decisions.recent(500))
    r = await client.post(demo.proxy.url("ollama") + "/api/generate", json={"model": biggest, "keep_alive": 0})
    if r.status_code != 200 or r.json().get("done_reason") != "unload":
        raise AssertionError(f"unload of {biggest} answered {r.status_code}: {r.text[:200]}")
    made = [d.kind for d in demo.proxy.decisions.recent(500)[before:]]
    if made:
        raise AssertionError(f"an unload made decisions: {made}")
    return f"{biggest} unloaded, no plan, no release"


async def _rejection_check(demo: Demo, client: httpx.AsyncClient) -> str:
    """The largest model, when even releasing everyone reclaimable cannot make room: 507 with blockers."""
    assert demo.proxy and demo.box.ollama
    await _unload_ollama(demo, client)
    biggest = max((m for m in demo.box.ollama.config.models if "completion" in m.capabilities), key=lambda m: m.size_bytes)
    r = await client.post(demo.proxy.url("ollama") + "/api/generate",
                          json={"model": biggest.name, "prompt": "hi", "stream": False})
    if r.status_code == 200:
        return f"not applicable: {biggest.name} fits this card once others are released"
    if r.status_code != 507:
        raise AssertionError(f"{biggest.name} answered {r.status_code}: {r.text[:200]}")
    body = r.json()
    blockers = ", ".join(f"{b['cmdline'] or b['name']} (pid {b['pid']}, {b['vram_gb']} GiB, {b['reason']})"
                         for b in body["blockers"] if b["reason"] == "unmanaged")
    return (f"507 for {biggest.name} (needs {body['need_gb']} GiB, {body['available_gb']} GiB reachable): "
            f"{blockers or 'no unmanaged blocker'}")


async def _relay_stopped_and_started(demo: Demo, client: httpx.AsyncClient) -> str:
    """The speech relay (a `process` tenant) is not started by a read (503), runs after a
    request that needs it (an empty POST: answered); a render that needs its memory
    stops it (a `stop` decision, the child gone, its memory back on the card); the next request to
    its listener starts it again (a `start` decision, 200)."""
    assert demo.proxy and demo.box.comfyui and demo.box.scenario.relay
    spec, proxy, gpu = demo.box.scenario.relay, demo.proxy, demo.box.gpu
    name = spec.tenant
    machine = proxy.arbitration.lifecycles.machine(name)
    if machine is None:
        raise AssertionError(f"{name} is not a tenant the proxy starts and stops")
    if demo.box.ollama:
        await _unload_ollama(demo, client)  # so that the render needs the relay's memory, not Ollama's
    expect_ok(await client.post(proxy.url("admin") + "/api/tenants/comfyui/release"), "comfyui's release")
    relay = proxy.url(name)
    before = len(proxy.decisions.recent(500))
    polled = await client.get(relay + "/health")
    if polled.status_code != 503 or machine.state != "stopped":
        raise AssertionError(f"a read of the stopped {name} answered {polled.status_code} and left it {machine.state}: "
                             "a read must not start it (wake_on \"writes\")")
    expect_ok(await client.post(relay + "/v1/audio/transcriptions", content=b"",
                                headers={"Content-Type": "audio/wav"}), f"the first request to {name}")
    pid = machine.controller.describe().get("pid")
    if machine.state != "running" or not isinstance(pid, int) or pid not in gpu.real_pids():
        raise AssertionError(f"{name} is {machine.state} after its first request; on the card: {gpu.real_pids()}")
    ckpts, reg = demo.box.comfyui.config.checkpoints, proxy.registry.get("comfyui")
    ckpt = max(ckpts, key=lambda k: ckpts[k])
    need = int(reg.model_vram_gb.get(ckpt, reg.needs_vram_gb) * GIB)
    if need <= gpu.free_bytes() + gpu.used_by(demo.box.comfyui.pid or 0):
        return f"not applicable: {ckpt} fits beside {name}"
    await _render(demo, client, ckpt)
    made = proxy.decisions.recent(500)[before:]
    stops = [d for d in made if d.kind == "stop" and d.tenant == name]
    if not stops or stops[-1].outcome.get("ok") is not True:
        raise AssertionError(f"{ckpt} rendered but {name} was not stopped: {[(d.kind, d.tenant) for d in made]}")
    if machine.state != "stopped" or pid in gpu.real_pids():
        raise AssertionError(f"{name} is {machine.state} after its stop; pid {pid} on the card: {pid in gpu.real_pids()}")
    stop_s = stops[-1].outcome.get("duration_s")
    said = expect_ok(await client.post(relay + "/v1/audio/transcriptions", content=b"RIFF" + bytes(4096),
                                       headers={"Content-Type": "audio/wav"}), f"the next request to {name}")
    starts = [d for d in proxy.decisions.recent(500)[before:] if d.kind == "start" and d.tenant == name]
    if len(starts) != 2 or machine.state != "running" or "text" not in said.json():
        raise AssertionError(f"{name} was not started again: {len(starts)} start(s), {machine.state}, {said.text[:120]}")
    return (f"{name} started ({starts[0].outcome.get('duration_s')} s), stopped for {ckpt} ({stop_s} s, "
            f"{spec.vram_gb:g} GiB back), started again ({starts[1].outcome.get('duration_s')} s), 200")


def expect_ok(r: httpx.Response, what: str) -> httpx.Response:
    if r.status_code != 200:
        raise AssertionError(f"{what} answered {r.status_code}: {r.text[:200]}")
    return r


# -- the demo's terminal: one readable line per decision ----------------------------------------------

def decision_line(view: DecisionView) -> str:
    """A decision, once complete, as one line a person reads (the demo's terminal; `serve` and
    `demo --json-logs` log each event as a JSON object instead)."""
    o, t = view.outcome, view.tenant or "the card"
    match view.kind:
        case "queued":
            waited = f"waited {o['waited_s']:.1f} s" if "waited_s" in o else "waiting"
            behind = f" behind #{o['behind']}" if o.get("behind") else ""
            whom = ", ".join(o.get("waiting_for") or []) or "memory"
            text = f"{t} {waited} for {whom}{behind}: {o.get('result', 'still waiting')}"
        case "rejection":
            text = f"{t} refused {o.get('status')}: {o.get('reason')}"
        case "plan" | "oom_retry" | "spill" | "idle_release" | "release":
            retry = o.get("oom_retry") or (o.get("result") if view.kind == "oom_retry" else None)
            text = f"{t}: " + (_releases_line(o) if o.get("releases") or retry is None else "nothing released")
            if retry is not None:
                text += f"; retry after out of memory: {retry}"
        case "model_load":
            cls = f", {o['class']}" if o.get("class") else ""
            text = f"{t} loaded {o.get('model')} in {o.get('seconds', 0):.1f} s ({o.get('gbps', 0):.2f} GB/s{cls})"
        case "start" | "stop" | "exit":
            done = {"start": "started", "stop": "stopped", "exit": "exited"}[view.kind]
            text = (f"{t} {done} in {o.get('duration_s', 0):.1f} s" if o.get("ok") or view.kind == "exit"
                    else f"{t} {view.kind} failed: {o.get('error')}")
        case _:
            facts = "; ".join(f"{k} {v}" for k, v in o.items() if isinstance(v, (str, int, float)) and k != "ok")
            text = f"{t}: {facts}" if facts else t
    ok = "" if o.get("ok", True) is not False else " [FAILED]"
    return f"#{view.id} {view.kind:<12} {text}{ok}  ({view.trigger})"


def _releases_line(o: Mapping[str, Any]) -> str:
    releases = o.get("releases") or []
    if not releases:
        return str(o.get("result") or "nothing to release")
    parts = []
    for r in releases:
        if r.get("confirmed") or r.get("result") == "estimated":
            est = ", estimated" if r.get("result") == "estimated" else ""
            parts.append(f"{r['tenant']} released ({r['freed_gb']} GiB back in {r['duration_s']:.1f} s{est})")
        else:
            parts.append(f"{r['tenant']} not released ({r.get('result')}: {r.get('error') or 'memory not back'})")
    return ", ".join(parts)


class DecisionPrinter:
    """Subscribed to the decision log: prints a decision's line when it is complete (a wait when it
    ends, a handoff when its releases came back, a refusal, a load, a start or stop)."""

    def __init__(self, proxy: Proxy, out: TextIO | None = None) -> None:
        self.proxy, self.out = proxy, out
        self._unsubscribe = proxy.decisions.subscribe(self.on_event)

    def on_event(self, event: DecisionEvent) -> None:
        if not (completes(event) or isinstance(event, (ModelLoad, LifecycleExit, GpuDrift))):
            return
        view = self.proxy.decisions.view_of(event)
        if view is not None:
            stamp = time.strftime("%H:%M:%S", time.localtime(view.at))
            print(f"{stamp} {decision_line(view)}", file=self.out or sys.stderr, flush=True)

    def close(self) -> None:
        self._unsubscribe()


def print_report(results: list[tuple[str, bool, str]]) -> bool:
    for name, ok, detail in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {name:<34} {detail}")
    failed = [r for r in results if not r[1]]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return not failed


async def demo_main(scenario: str, check: bool, with_proxy: bool = True, fast: bool = False,
                    config: str | None = None, readable_log: bool = False) -> int:
    """`readable_log`: one line per decision on stderr (the default of `hyperswap demo`; its
    `--json-logs` keeps the JSON log lines `serve` writes)."""
    # --fast: the same box with the engines' load, unload and step delays cut to milliseconds (what the
    # tests run on), so a check after an install takes seconds instead of a minute and a half.
    demo = await start_demo(fast_scenario(scenario) if fast else scenario, with_proxy=with_proxy, watchdog=not check,
                            config=config, scenario_name=scenario)
    settle_heap()
    try:
        print(describe(demo, scenario), flush=True)
        if fast:
            print("(--fast: the simulated engines load, unload and render in milliseconds)", flush=True)
        if check:
            print("\nself-test:")
            return 0 if print_report(await self_test(demo)) else 1
        if readable_log and demo.proxy:
            DecisionPrinter(demo.proxy)
            print("\nDecisions, one line each as they complete:", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("\nstopping...", file=sys.stderr)
        return 0
    finally:
        await demo.stop()
