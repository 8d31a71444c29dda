"""`hyperswap demo`: the proxy in front of a simulated GPU, Ollama and ComfyUI, on loopback.

`--check` runs the self-test (proxy/demo_check.py) of every simulator route and the handoffs through
the proxy, prints the result and exits 0/1. Without it the demo runs until Ctrl-C and then stops
everything it started.
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
from typing import Literal, TextIO

import httpx
from websockets.asyncio.client import connect as ws_connect

from proxy.admin.telemetry import ENV_VAR as ENV_TELEMETRY
from proxy.admin.telemetry import Telemetry
from proxy.admin.telemetry_rows import completes
from proxy.clock import Clock, SystemClock
from proxy.config.units import GIB
from proxy.decision_base import DecisionEvent
from proxy.encoding import JSONObject
from proxy.engines.loading import load_registry_over, registry_from_dict
from proxy.gpu.keeper import GpuDrift
from proxy.handoff.decisions import DecisionView, LifecycleExit, ModelLoad, Resumed
from proxy.handoff.outcome import DecisionOutcome
from proxy.relay.servers import settle_heap
from proxy.service import Proxy
from proxy.sim.box import Scenario, SimBox, fast_scenario, load_scenario
from proxy.sim.box import scenario_names as scenario_names  # for `demo --help` (cli.py never imports proxy.sim)

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
            proxy = Proxy(registry, box.gpu, clock, watchdog_enabled=watchdog, config_note=note,
                          checkpointer=box.checkpointer)
            await proxy.start(proxy_ports)
        except BaseException:
            await box.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    return Demo(box, proxy, path, workdir)


def _own_history(workdir: Path) -> JSONObject:
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
                  f"  curl -sN {o}/api/generate -d '{{\"model\":\"{big}\",\"prompt\":\"hi\"}}'   "
                  + ("# Ollama needs it back: streamed, each step told" if demo.box.gpu.device_count == 1
                     else "# on its own GPU: nothing released"),
                  f"  curl -s {a}/api/decisions | python3 -m json.tool          # what the proxy decided and why",
                  f"  curl -s {a}/api/models | python3 -m json.tool             # model files: size, how much is in RAM"]
        suspending = list(demo.proxy.broker.lifecycles.suspensions.records())
        if suspending:  # release kind cuda_suspend: the render again is a restore, not a checkpoint read
            lines += [f"  curl -s {a}/api/gpu | python3 -m json.tool                # host_ram: what "
                      f"{' and '.join(suspending)} parked while suspended",
                      f"  curl -s {c}/prompt -d @{demo.example_prompt()}      # again: restored from host RAM, "
                      "its checkpoint not read again"]
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


def engine_card(demo: Demo, engine: Literal["ollama", "comfyui"]) -> int:
    spec = demo.box.scenario.engines.get(engine)
    return spec.gpu if spec is not None else 0


# -- the self-test ---------------------------------------------------------------------------------

def comfy_prompt(ckpt: str, seed: int | None = None) -> JSONObject:
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


async def run_prompt(base: str, ckpt: str, client: httpx.AsyncClient, timeout_s: float = 30.0) -> list[JSONObject]:
    """Queue a prompt with a websocket open and return its messages up to the end marker."""
    cid = uuid.uuid4().hex
    ws_url = base.replace("http://", "ws://") + f"/ws?clientId={cid}"
    async with ws_connect(ws_url, max_size=None, ping_interval=None) as ws:
        json.loads(await ws.recv())  # status with sid
        r = await client.post(f"{base}/prompt", json={"prompt": comfy_prompt(ckpt), "client_id": cid})
        r.raise_for_status()
        pid = r.json()["prompt_id"]
        msgs: list[JSONObject] = []
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await ws.recv()
                if isinstance(raw, bytes):
                    continue
                m = json.loads(raw)
                msgs.append(m)
                if m["type"] == "executing" and m["data"].get("node") is None and m["data"].get("prompt_id") == pid:
                    return msgs


def decision_line(view: DecisionView) -> str:
    """A decision, once complete, as one line a person reads (the demo's terminal; `serve` and
    `demo --json-logs` log each event as a JSON object instead)."""
    o, t = view.read(), view.tenant or "the card"
    match view.kind:
        case "queued":
            text = _wait_line(t, o)
        case "rejection":
            text = f"{t} refused {o.status}: {o.reason}"
        case "plan" | "oom_retry" | "spill" | "idle_release" | "release":
            text = _handoff_line(t, o, view.kind == "oom_retry")
        case "model_load":
            text = _load_line(t, o)
        case "resume" if o.asked is not None and "restored" in o.asked:
            text = _restored_line(t, o.asked)
        case "start" | "stop" | "exit":
            text = _process_line(t, view.kind, o)
        case _:
            text = _facts_line(t, view.outcome)
    ok = "" if o.ok is not False else " [FAILED]"
    return f"#{view.id} {view.kind:<12} {text}{ok}  ({view.trigger})"


def _load_line(t: str, o: DecisionOutcome) -> str:
    cls = f", {o.load_class}" if o.load_class else ""
    return f"{t} loaded {o.model} in {o.seconds or 0:.1f} s ({o.gbps or 0:.2f} GB/s{cls})"


def _process_line(t: str, kind: str, o: DecisionOutcome) -> str:
    """A process tenant's start, stop or exit: how long it took, or why it failed (an exit never fails)."""
    done = {"start": "started", "stop": "stopped", "exit": "exited"}[kind]
    return (f"{t} {done} in {o.duration_s or 0:.1f} s" if o.ok or kind == "exit"
            else f"{t} {kind} failed: {o.error}")


def _facts_line(t: str, outcome: Mapping[str, object]) -> str:
    """Any other decision: its outcome's plain facts (not `ok`, which the line's end says)."""
    facts = "; ".join(f"{k} {v}" for k, v in outcome.items() if isinstance(v, str | int | float) and k != "ok")
    return f"{t}: {facts}" if facts else t


def _restored_line(t: str, back: Mapping[str, object]) -> str:
    if back.get("restored") is None:
        return f"{t} could not be restored: {back.get('fallback')}"
    return (f"{t} restored from host RAM ({_number(back.get('bytes')) / GIB:.1f} GiB back on the card in "
            f"{_number(back.get('duration_s')):.2f} s, {back.get('via')})")


def _number(value: object) -> float:
    """A figure of an engine's answer; 0 when it gave none."""
    return float(value) if isinstance(value, int | float) else 0.0


def _wait_line(t: str, o: DecisionOutcome) -> str:
    waited = f"waited {o.waited_s:.1f} s" if o.waited_s is not None else "waiting"
    behind = f" behind #{o.behind}" if o.behind else ""
    whom = ", ".join(o.waiting_for or []) or "memory"
    return f"{t} {waited} for {whom}{behind}: {o.result or 'still waiting'}"


def _handoff_line(t: str, o: DecisionOutcome, oom_retry: bool) -> str:
    retry = o.oom_retry or (o.result if oom_retry else None)
    text = f"{t}: " + (_releases_line(o) if o.releases or retry is None else "nothing released")
    return text if retry is None else f"{text}; retry after out of memory: {retry}"


def _releases_line(o: DecisionOutcome) -> str:
    releases = o.releases or []
    if not releases:
        return str(o.result or "nothing to release")
    parts = []
    for r in releases:
        asked = r.asked or {}
        if (r.confirmed or r.result == "estimated") and "suspended" in asked:
            parts.append(f"{r.tenant} suspended into host RAM ({_number(asked.get('parked_bytes')) / GIB:.1f} GiB "
                         f"parked in {r.duration_s:.1f} s, {asked.get('via')})")
        elif r.confirmed or r.result == "estimated":
            est = ", estimated" if r.result == "estimated" else ""
            parts.append(f"{r.tenant} released ({r.freed_gb} GiB back in {r.duration_s:.1f} s{est})")
        else:
            parts.append(f"{r.tenant} not released ({r.result}: {r.error or 'memory not back'})")
    return ", ".join(parts)


class DecisionPrinter:
    """Subscribed to the decision log: prints a decision's line when it is complete (a wait when it
    ends, a handoff when its releases came back, a refusal, a load, a start or stop)."""

    def __init__(self, proxy: Proxy, out: TextIO | None = None) -> None:
        self.proxy, self.out = proxy, out
        self._printed: set[int] = set()  # a decision's later facts (a load's first byte) print nothing again
        self._unsubscribe = proxy.decisions.subscribe(self.on_event)

    def on_event(self, event: DecisionEvent) -> None:
        if not (completes(event) or isinstance(event, (ModelLoad, LifecycleExit, GpuDrift, Resumed))):
            return
        view = self.proxy.decisions.view_of(event)
        if view is not None and view.id not in self._printed:
            self._printed.add(view.id)
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


SelfTest = Callable[[Demo], Awaitable[list[tuple[str, bool, str]]]]


async def demo_main(scenario: str, check: SelfTest | None, with_proxy: bool = True, fast: bool = False,
                    config: str | None = None, readable_log: bool = False) -> int:
    """`check`: run this self-test (`demo_check.self_test`) and exit 0/1, else run until Ctrl-C.
    `readable_log`: one line per decision on stderr (the default of `hyperswap demo`; its
    `--json-logs` keeps the JSON log lines `serve` writes)."""
    # --fast: the same box with the engines' load, unload and step delays cut to milliseconds (what the
    # tests run on), so a check after an install takes seconds instead of a minute and a half.
    demo = await start_demo(fast_scenario(scenario) if fast else scenario, with_proxy=with_proxy, watchdog=check is None,
                            config=config, scenario_name=scenario)
    settle_heap()
    try:
        print(describe(demo, scenario), flush=True)
        if fast:
            print("(--fast: the simulated engines load, unload and render in milliseconds)", flush=True)
        if check:
            print("\nself-test:")
            return 0 if print_report(await check(demo)) else 1
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
