"""Mixed bursts: renders and chats (and, with --relay, transcriptions) sharing one card, against the
best order any scheduler could have found.

Not a test: run `python bench/mixed.py` (about 8 minutes: 20 random bursts of 2-8 requests, seed 32,
then the patterns RCRC CRCR RCRCRC RRCC), or shorter with `--bursts 5 --sizes 2-4 --patterns`.
The demo box runs in this process (`proxy.demo.start_demo`, every port picked by the system) at the
simulators' real speeds (the shipped scenario, not the fast one: a 16.2 GiB chat model loads in
about 8.7 s, a 6.5 GiB checkpoint in 1.6 s), with `queue_timeout_s` from --queue-timeout-s and
`swap_hold_s` from --swap-hold-s (the proxy's default unless given; 0: off).

A burst is a string of request kinds sent --gap-s apart, each by a plain HTTP client through the
proxy's listeners:
- R: a ComfyUI render (POST /prompt of a 4-step graph, a new seed each time, then GET /history/<id>
  every 20 ms until it completed or failed; with --websocket, as ComfyUI's frontend does: its
  websocket open through the proxy, done at the end marker, which the proxy then sees too);
- C: an Ollama chat (POST /api/generate, not streamed);
- S (--relay, the `lifecycle` scenario): a transcription to the speech relay, an app the proxy
  starts on demand and stops when a render needs its memory.
The default box holds a render's checkpoint (plus its working memory) or the chat model, never
both; on the lifecycle box (16 GiB) a render's checkpoint fills the card and the chat model and the
relay fit together.

Per burst: the makespan (first send to the last request's end), the handoffs (the proxy's plans
that released someone, from GET /api/decisions), every request's status, and its wait: send to
admission, i.e. what the proxy added before the engine had the request (a render: the answer to
POST /prompt, which the proxy holds until admitted; a chat: the answer's time minus Ollama's own
total_duration; a transcription: its time minus a warm one's, so a start counts as wait). A
Server-Timing header, where the proxy sends one, is kept in the JSON.

The oracle (bench/oracle.py): for bursts of up to --oracle-max requests, the best makespan of any
order the card allows, found by exhaustive search, from the same arrival times and the card's state
at the burst's start, with service times measured on this box in this run first (each kind's
request with its model on the card, the load it adds when not, the release from the admin API's
call to the memory back on the card; each tenant's peak, its idle hold with its model loaded and its
floor once released, on the card), printed beside the
values the simulators' parameters give. The ratio makespan / oracle is the scheduler's score; the
target (issue 32) is <= 1.25 on bursts of up to 8 requests. The oracle knows the whole burst from
its first send: it may leave a render waiting on an idle card for chats not sent yet. Beside it,
the no-lookahead oracle: the best schedule that never leaves the card idle while a sent request
waits (what a scheduler that serves what has arrived can at best do; not a bound for one that
waits to see what comes).

Results: bench/results/mixed.json (or --out), a table per burst and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect as ws_connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.oracle import Service, best_schedule  # noqa: E402
from proxy.demo import Demo, comfy_prompt, start_demo  # noqa: E402
from proxy.tasks import poll_until  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "mixed.json"
GIB = 2**30
POLL_S = 0.02  # /history polls
SETTLE_S = 1.0  # after a burst: releases under way end, the card is steady for the next start state
NAMED = ["RCRC", "CRCR", "RCRCRC", "RRCC"]
ORACLE_ASSUMES = ("each tenant serves one request at a time; a kind's model is loaded (or its app started) once per "
                  "residency; models stay together while the card holds them idle plus the one serving at its peak; "
                  "a release starts no earlier than the request that needs the room and the victim's last request's "
                  "end; tenants that fit together run at the same time; service times are this run's medians of lone "
                  "requests; the card's state at the burst's start as read then; it knows the whole burst at its "
                  "first send (the no-lookahead oracle: never an idle card while a sent request waits)")


@dataclass(frozen=True, slots=True)
class Setup:
    scenario: str
    checkpoint: str
    model: str
    tenants: dict[str, str]  # kind -> tenant

    @property
    def kinds(self) -> str:
        return "".join(self.tenants)


SETUPS = {
    "default": Setup("default", "sd_xl_base_1.0.safetensors", "gemma3:27b", {"R": "comfyui", "C": "ollama"}),
    "lifecycle": Setup("lifecycle", "flux1-dev-fp8.safetensors", "qwen2.5:14b",
                       {"R": "comfyui", "C": "ollama", "S": "stt"}),
}


@dataclass(slots=True)
class Answer:
    kind: str
    status: int | str  # the HTTP status, or "error" (the render failed), "unfinished", "timeout", "transport"
    sent_s: float = 0.0  # from the burst's first send
    end_s: float = 0.0
    wait_s: float | None = None
    server_timing: str | None = None
    engine_load_s: float | None = None  # a chat: Ollama's load_duration


# --------------------------------------------------------------------------------------------
# the clients


class Clients:
    def __init__(self, demo: Demo, setup: Setup, client: httpx.AsyncClient) -> None:
        assert demo.proxy is not None
        self.demo, self.setup, self.client = demo, setup, client
        self.urls = {k: demo.proxy.url(t) for k, t in setup.tenants.items()}
        self.admin = demo.proxy.url("admin")
        self.seed = random.Random(0)
        self.relay_run_s = 0.0  # a warm transcription, once measured
        self.websocket = False  # renders with their websocket open (--websocket) instead of /history polls

    async def send(self, kind: str, t0: float, timeout_s: float) -> Answer:
        fn: Callable[[float, float], Awaitable[Answer]] = {"R": self.render, "C": self.chat, "S": self.speech}[kind]
        try:
            return await fn(t0, timeout_s)
        except httpx.TimeoutException:
            return Answer(kind, "timeout", end_s=time.perf_counter() - t0)
        except httpx.TransportError as exc:
            return Answer(kind, f"transport {type(exc).__name__}", end_s=time.perf_counter() - t0)

    async def render(self, t0: float, timeout_s: float) -> Answer:
        if self.websocket:
            return await self.render_ws(t0, timeout_s)
        base = self.urls["R"]
        graph = comfy_prompt(self.setup.checkpoint, seed=self.seed.randrange(1 << 30))  # never the cached path
        sent = time.perf_counter()
        r = await self.client.post(base + "/prompt", json={"prompt": graph}, timeout=timeout_s)
        a = Answer("R", r.status_code, sent - t0, time.perf_counter() - t0, time.perf_counter() - sent,
                   r.headers.get("server-timing"))
        if r.status_code != 200:
            return a
        pid = r.json()["prompt_id"]
        a.status = "unfinished"
        while time.perf_counter() - sent < timeout_s:
            h = await self.client.get(base + f"/history/{pid}")
            status = h.json().get(pid, {}).get("status", {}) if h.status_code == 200 else {}
            if status.get("completed"):
                a.status = 200
                break
            if status.get("status_str") == "error":
                a.status = "error"
                break
            await asyncio.sleep(POLL_S)
        a.end_s = time.perf_counter() - t0
        return a

    async def render_ws(self, t0: float, timeout_s: float) -> Answer:
        """A render as ComfyUI's own frontend sends it: its websocket open through the proxy, done at
        the end marker (which the proxy sees too: the job's end is known at once)."""
        base = self.urls["R"]
        cid = uuid.uuid4().hex
        graph = comfy_prompt(self.setup.checkpoint, seed=self.seed.randrange(1 << 30))
        async with ws_connect(base.replace("http://", "ws://") + f"/ws?clientId={cid}", max_size=None,
                              ping_interval=None) as ws:
            await ws.recv()  # status with sid
            sent = time.perf_counter()
            r = await self.client.post(base + "/prompt", json={"prompt": graph, "client_id": cid}, timeout=timeout_s)
            a = Answer("R", r.status_code, sent - t0, time.perf_counter() - t0, time.perf_counter() - sent,
                       r.headers.get("server-timing"))
            if r.status_code != 200:
                return a
            pid = r.json()["prompt_id"]
            a.status = "unfinished"
            try:
                async with asyncio.timeout(max(0.0, timeout_s - (time.perf_counter() - sent))):
                    while True:
                        raw = await ws.recv()
                        if not isinstance(raw, str):
                            continue
                        m = json.loads(raw)
                        if m.get("type") == "execution_error" and m["data"].get("prompt_id") == pid:
                            a.status = "error"
                        elif m.get("type") == "executing" and m["data"].get("node") is None \
                                and m["data"].get("prompt_id") == pid:
                            a.status = 200 if a.status == "unfinished" else a.status
                            break
            except TimeoutError:
                pass
        a.end_s = time.perf_counter() - t0
        return a

    async def chat(self, t0: float, timeout_s: float) -> Answer:
        sent = time.perf_counter()
        r = await self.client.post(self.urls["C"] + "/api/generate", timeout=timeout_s,
                                   json={"model": self.setup.model, "prompt": "hi", "stream": False})
        took = time.perf_counter() - sent
        a = Answer("C", r.status_code, sent - t0, time.perf_counter() - t0, None, r.headers.get("server-timing"))
        if r.status_code == 200:
            body = r.json()
            a.wait_s = max(0.0, took - body["total_duration"] / 1e9)
            a.engine_load_s = body.get("load_duration", 0) / 1e9
        return a

    async def speech(self, t0: float, timeout_s: float) -> Answer:
        sent = time.perf_counter()
        r = await self.client.post(self.urls["S"] + "/v1/audio/transcriptions", content=b"RIFF" + bytes(4096),
                                   timeout=timeout_s)
        took = time.perf_counter() - sent
        return Answer("S", r.status_code, sent - t0, time.perf_counter() - t0,
                      max(0.0, took - self.relay_run_s) if r.status_code == 200 else None, r.headers.get("server-timing"))

    async def release(self, tenant: str) -> float:
        """Seconds from the admin API's release call to the tenant's memory back on the card (the call
        that was not refused as busy)."""
        async with asyncio.timeout(30):
            while True:  # busy (409) until the proxy's own job poll saw the last render end: ask again
                began = time.perf_counter()
                r = await self.client.post(self.admin + f"/api/tenants/{tenant}/release", timeout=60)
                if r.status_code != 409:
                    break
                await asyncio.sleep(0.05)
        if r.status_code != 200:
            raise RuntimeError(f"release {tenant}: {r.status_code} {r.text[:200]}")
        card = Card(self.demo, self.setup)
        floor = card.floors.get(tenant, 0)
        async with asyncio.timeout(30):
            await poll_until(lambda: card.held().get(tenant, 0) <= floor + 64 * 2**20, 0.002)
        return time.perf_counter() - began

    async def decisions_after(self, last_id: int) -> list[dict[str, Any]]:
        r = await self.client.get(self.admin + "/api/decisions", params={"limit": 500})
        return [d for d in r.json().get("decisions", []) if d["id"] > last_id]

    async def last_decision(self) -> int:
        return max((d["id"] for d in await self.decisions_after(0)), default=0)


# --------------------------------------------------------------------------------------------
# the card: who holds what


class Card:
    def __init__(self, demo: Demo, setup: Setup) -> None:
        self.demo, self.setup = demo, setup
        comfy = demo.box.comfyui
        self.floors = {"comfyui": comfy.config.context_floor_bytes if comfy else 0}

    def held(self) -> dict[str, int]:
        """Bytes per tenant on the card now; "other" for what no tenant holds (the desktop)."""
        gpu = self.demo.box.gpu
        real = set(gpu.real_pids())
        comfy_pid = self.demo.box.comfyui.pid if self.demo.box.comfyui else -1
        out: Counter[str] = Counter()
        for p in gpu.read().processes:
            used = p.used_bytes or 0
            if p.pid == comfy_pid:
                out["comfyui"] += used
            elif p.name == "ollama_llama_server":
                out["ollama"] += used
            elif p.pid in real:
                out["stt"] += used
            else:
                out["other"] += used
        return dict(out)

    def capacity(self) -> int:
        gpu = self.demo.box.gpu
        return gpu.total_bytes - gpu.reserved_bytes - self.held().get("other", 0)

    def resident(self) -> frozenset[str]:
        """The kinds whose model is on the card (ComfyUI above its context floor)."""
        held = self.held()
        return frozenset(k for k, t in self.setup.tenants.items()
                         if held.get(t, 0) > self.floors.get(t, 0) + 256 * 2**20)


class PeakWatch:
    """Each tenant's most and least on the card, sampled every 5 ms while calibrating."""

    def __init__(self, card: Card) -> None:
        self.card = card
        self.peak: Counter[str] = Counter()
        self.low: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            held = self.card.held()
            for t in self.card.setup.tenants.values():
                self.peak[t] = max(self.peak[t], held.get(t, 0))
                self.low[t] = min(self.low.get(t, held.get(t, 0)), held.get(t, 0))
            await asyncio.sleep(0.005)

    def __enter__(self) -> PeakWatch:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()


# --------------------------------------------------------------------------------------------
# calibration: each kind alone, on the same box


async def calibrate(clients: Clients, card: Card, rounds: int, timeout_s: float) -> tuple[dict[str, Service], dict[str, Any]]:
    setup = clients.setup
    cold: dict[str, list[float]] = {k: [] for k in setup.kinds}
    warm: dict[str, list[float]] = {k: [] for k in setup.kinds}
    release: dict[str, list[float]] = {k: [] for k in setup.kinds}
    rest: dict[str, list[int]] = {k: [] for k in setup.kinds}  # held once the warm request ended, idle

    async def one(kind: str) -> float:
        t0 = time.perf_counter()
        a = await clients.send(kind, t0, timeout_s)
        if a.status != 200:
            raise SystemExit(f"calibration: a lone {kind} answered {a.status}: the box is not usable")
        return a.end_s

    with PeakWatch(card) as watch:
        for k in setup.kinds:  # warm-up: every file read once (the first loads read from "disk")
            await one(k)
        for _ in range(rounds):
            for k in setup.kinds:
                for other, t in setup.tenants.items():  # the card empty, so the cold request hands nothing off
                    if other != k and other in card.resident():
                        release[other].append(await clients.release(t))
                if k in card.resident():
                    release[k].append(await clients.release(setup.tenants[k]))
                cold[k].append(await one(k))
                warm[k].append(await one(k))
                rest[k].append(card.held().get(setup.tenants[k], 0))
                if k == "S":
                    clients.relay_run_s = statistics.median(warm["S"])
    services: dict[str, Service] = {}
    for k, t in setup.tenants.items():
        run = statistics.median(warm[k])
        services[k] = Service(run_s=run, load_s=max(0.0, statistics.median(cold[k]) - run),
                              release_s=statistics.median(release[k]) if release[k] else 0.0,
                              peak_bytes=watch.peak[t], floor_bytes=watch.low.get(t, 0),
                              rest_bytes=int(statistics.median(rest[k])))
    measured = {k: {"run_s": round(s.run_s, 3), "load_s": round(s.load_s, 3), "release_s": round(s.release_s, 3),
                    "rest_gib": round(s.rest / GIB, 2), "peak_gib": round(s.peak_bytes / GIB, 2),
                    "floor_gib": round(s.floor_bytes / GIB, 2),
                    "samples": {"cold_s": [round(x, 3) for x in cold[k]], "warm_s": [round(x, 3) for x in warm[k]],
                                "release_s": [round(x, 3) for x in release[k]]}}
                for k, s in services.items()}
    return services, measured


def from_parameters(demo: Demo, setup: Setup) -> dict[str, dict[str, float]]:
    """What the simulators' parameters say the same quantities are (files in the page cache)."""
    out: dict[str, dict[str, float]] = {}
    if demo.box.comfyui:
        c = demo.box.comfyui.config
        prompt: dict[str, Any] = comfy_prompt(setup.checkpoint)
        steps = prompt["3"]["inputs"]["steps"]
        out["R"] = {"run_s": steps * c.step_time_s, "load_s": c.checkpoints[setup.checkpoint] / (c.load_gbps * GIB),
                    "release_s": c.free_delay_s,
                    "rest_gib": (c.checkpoints[setup.checkpoint] + c.context_floor_bytes) / GIB,
                    "peak_gib": (c.checkpoints[setup.checkpoint] + c.working_bytes + c.context_floor_bytes) / GIB,
                    "floor_gib": c.context_floor_bytes / GIB}
    if demo.box.ollama:
        o = demo.box.ollama.config
        size = next(m.size_bytes for m in o.models if m.name == setup.model)
        out["C"] = {"run_s": o.response_tokens / o.token_rate, "load_s": size / (o.load_gbps * 1e9),
                    "release_s": o.unload_delay_s, "rest_gib": size / GIB, "peak_gib": size / GIB, "floor_gib": 0.0}
    relay = demo.box.scenario.relay
    if relay is not None and "S" in setup.tenants:
        out["S"] = {"run_s": relay.transcribe_s, "load_s": relay.load_s, "release_s": 0.0,
                    "rest_gib": relay.vram_gb, "peak_gib": relay.vram_gb, "floor_gib": 0.0}
    return {k: {q: round(v, 3) for q, v in d.items()} for k, d in out.items()}


# --------------------------------------------------------------------------------------------
# bursts


@dataclass(slots=True)
class Burst:
    name: str
    pattern: str
    start_resident: str
    makespan_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    handoffs: int = 0
    released: list[str] = field(default_factory=list)  # whom each handoff released, in order
    queued: int = 0  # "queued" decisions
    rejections: list[int] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)  # the burst's, condensed, for the JSON
    oracle_s: float | None = None
    oracle_order: str | None = None
    oracle_handoffs: int | None = None
    now_s: float | None = None  # the best schedule that never leaves the card idle while a request waits
    now_order: str | None = None
    now_handoffs: int | None = None

    @property
    def ratio(self) -> float | None:
        return self.makespan_s / self.oracle_s if self.oracle_s else None

    @property
    def ratio_now(self) -> float | None:
        return self.makespan_s / self.now_s if self.now_s else None

    @property
    def waits(self) -> list[float]:
        return [a.wait_s for a in self.answers if a.wait_s is not None]

    @property
    def statuses(self) -> str:
        return " ".join(f"{a.kind}{a.status}" for a in self.answers)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "answers"}
        out.update(ratio=self.ratio, ratio_now=self.ratio_now, wait_p50_s=pct(self.waits, 50), wait_p99_s=pct(self.waits, 99),
                   answers=[asdict(a) for a in self.answers])
        return out


def pct(xs: list[float], p: float) -> float | None:
    """The p-th percentile, nearest rank (with 8 values p99 is the largest)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * p / 100) - 1))]


async def burst(clients: Clients, card: Card, services: dict[str, Service], name: str, pattern: str, gap_s: float,
                timeout_s: float, oracle_max: int) -> Burst:
    start = card.resident()
    capacity = card.capacity()
    b = Burst(name, pattern, "".join(sorted(start)) or "-")
    last = await clients.last_decision()
    t0, wall0 = time.perf_counter(), time.time()
    tasks = []
    for i, kind in enumerate(pattern):
        if i:
            await asyncio.sleep(max(0.0, t0 + i * gap_s - time.perf_counter()))
        tasks.append(asyncio.ensure_future(clients.send(kind, t0, timeout_s)))
    b.answers = list(await asyncio.gather(*tasks))
    b.makespan_s = max(a.end_s for a in b.answers)
    await asyncio.sleep(SETTLE_S)
    for d in await clients.decisions_after(last):
        plan = d.get("plan") or {}
        b.decisions.append({"id": d["id"], "at_s": round(d["at"] - wall0, 3), "kind": d.get("kind"),
                            "tenant": d.get("tenant"), "trigger": d.get("trigger"),
                            "releases": [r["tenant"] for r in plan.get("releases") or []],
                            "outcome": {k: v for k, v in (d.get("outcome") or {}).items() if k != "releases"}})
        if d.get("kind") == "plan" and plan.get("releases"):
            b.handoffs += 1
            b.released.append("+".join(r["tenant"] for r in plan["releases"]))
        elif d.get("kind") == "queued":
            b.queued += 1
        elif d.get("kind") == "rejection":
            b.rejections.append(int((d.get("outcome") or {}).get("status", 0)))
    if len(pattern) <= oracle_max:
        sent = [a.sent_s for a in b.answers]
        best = best_schedule(pattern, sent, start, services, capacity)
        b.oracle_s, b.oracle_order, b.oracle_handoffs = best.makespan_s, best.order, best.handoffs
        now = best_schedule(pattern, sent, start, services, capacity, work_conserving=True)
        b.now_s, b.now_order, b.now_handoffs = now.makespan_s, now.order, now.handoffs
    return b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def row(b: Burst) -> str:
    return (f"| {b.name} | {b.pattern} | {b.start_resident} | {b.makespan_s:.1f} | {fmt(b.oracle_s, '.1f')} "
            f"| {fmt(b.ratio)} | {fmt(b.now_s, '.1f')} | {fmt(b.ratio_now)} "
            f"| {b.handoffs} ({'' if b.oracle_handoffs is None else b.oracle_handoffs}) "
            f"| {fmt(pct(b.waits, 50), '.1f')} | {fmt(pct(b.waits, 99), '.1f')} | {b.statuses} |")


HEADER = ("| burst | pattern | on card at start | makespan s | oracle s | ratio | no-lookahead oracle s | ratio "
          "| handoffs (oracle) | wait p50 s | wait p99 s | statuses |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def parse_sizes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    setup = SETUPS["lifecycle" if args.relay else "default"]
    lo, hi = parse_sizes(args.sizes)
    rng = random.Random(args.seed)
    letters = setup.kinds
    plan = [(f"random {i + 1}", "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))))
            for i in range(args.bursts)]
    plan += [(p, p) for p in (args.patterns if args.patterns is not None else NAMED)]
    config = Path(tempfile.mkdtemp(prefix="bench-mixed-")) / "tenants.json"
    proxy: dict[str, float] = {"queue_timeout_s": args.queue_timeout_s}
    if args.swap_hold_s is not None:
        proxy["swap_hold_s"] = args.swap_hold_s
    config.write_text(json.dumps({"proxy": proxy}))
    ports = {t: 0 for t in setup.tenants.values()}
    sim_ports = {"ollama": 0, "comfyui": 0, **({"relay": 0} if args.relay else {})}
    began = time.perf_counter()
    load_before = os.getloadavg()
    demo = await start_demo(setup.scenario, sim_ports=sim_ports, proxy_ports={**ports, "admin": 0}, config=config)
    bursts: list[Burst] = []
    skipped: list[str] = []
    shortfalls: list[str] = []
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=args.burst_timeout_s) as client:
            clients = Clients(demo, setup, client)
            clients.websocket = args.websocket
            card = Card(demo, setup)
            services, measured = await calibrate(clients, card, args.calibration_rounds, args.burst_timeout_s)
            params = from_parameters(demo, setup)
            print(f"calibration ({time.perf_counter() - began:.0f} s): measured / from the simulators' parameters")
            print("| kind | run s | load s | release s | idle GiB | peak GiB | floor GiB |\n|---|---:|---:|---:|---:|---:|---:|")
            for k, m in measured.items():
                p = params.get(k, {})
                cells = [f"{m[q]} / {p.get(q, '?')}"
                         for q in ("run_s", "load_s", "release_s", "rest_gib", "peak_gib", "floor_gib")]
                print(f"| {k} | " + " | ".join(cells) + " |")
            print(f"card capacity for the tenants: {card.capacity() / GIB:.2f} GiB\n")
            print(HEADER, flush=True)
            for name, pattern in plan:
                if time.perf_counter() - began > args.budget_s:
                    skipped.append(name)
                    continue
                b = await burst(clients, card, services, name, pattern, args.gap_s, args.burst_timeout_s, args.oracle_max)
                bursts.append(b)
                print(row(b), flush=True)
        shortfalls = list(demo.box.gpu.shortfalls)  # every allocation the card refused: an OOM or a spill
    finally:
        await demo.stop()
    ratios = [r for b in bursts if (r := b.ratio) is not None]
    ratios_now = [r for b in bursts if (r := b.ratio_now) is not None]
    median_now = statistics.median(ratios_now) if ratios_now else None
    waits = [w for b in bursts for w in b.waits]
    statuses = Counter(str(a.status) for b in bursts for a in b.answers)
    median = statistics.median(ratios) if ratios else None
    worst = max(ratios, default=None)
    p50, p99 = pct(waits, 50), pct(waits, 99)
    handoffs, oracle_handoffs = sum(b.handoffs for b in bursts), sum(b.oracle_handoffs or 0 for b in bursts)
    within = sum(r <= 1.25 for r in ratios)
    seconds = round(time.perf_counter() - began, 1)
    print(f"\n{len(bursts)} bursts in {seconds} s; makespan / oracle median {fmt(median)}, max {fmt(worst)}, "
          f"{within} of {len(ratios)} within 1.25x; to the no-lookahead oracle median {fmt(median_now)}, "
          f"max {fmt(max(ratios_now, default=None))}; wait p50 {fmt(p50)} s, p99 {fmt(p99)} s; handoffs {handoffs} "
          f"(oracle {oracle_handoffs}); statuses {dict(statuses)}"
          + f"; OOMs {len(shortfalls)} (allocations the simulated card refused; renders that ended in error "
          f"{statuses.get('error', 0)})"
          + (f"; not run (over --budget-s): {', '.join(skipped)}" if skipped else ""))
    summary = {"bursts": len(bursts), "skipped_over_budget": skipped,
               "ooms": len(shortfalls), "shortfalls": shortfalls, "ratio_median": median, "ratio_max": worst,
               "ratio_now_median": median_now, "ratio_now_max": max(ratios_now, default=None),
               "within_1_25": within, "with_oracle": len(ratios), "wait_p50_s": p50, "wait_p99_s": p99,
               "handoffs": handoffs, "oracle_handoffs": oracle_handoffs, "statuses": dict(statuses), "seconds": seconds}
    return {
        "machine": {"nproc": os.cpu_count(), "uname_m": platform.machine(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "args": {**vars(args), "out": str(args.out)},
        "scenario": setup.scenario, "checkpoint": setup.checkpoint, "model": setup.model,
        "oracle_assumes": ORACLE_ASSUMES,
        "calibration": {"measured": measured, "from_parameters": params,
                        "capacity_gib": round(card.capacity() / GIB, 2)},
        "summary": summary, "bursts": [b.to_json() for b in bursts],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=32, help="the random bursts' seed")
    parser.add_argument("--bursts", type=int, default=20, help="how many random bursts")
    parser.add_argument("--sizes", default="2-8", help="random burst sizes, LO-HI requests")
    parser.add_argument("--patterns", nargs="*", default=None,
                        help=f"named bursts after the random ones (default: {' '.join(NAMED)}; none: --patterns alone)")
    parser.add_argument("--relay", action="store_true",
                        help="the lifecycle scenario (16 GiB card) with transcriptions (S) to the relay the proxy starts")
    parser.add_argument("--websocket", action="store_true",
                        help="renders wait on their websocket (through the proxy) instead of polling /history")
    parser.add_argument("--gap-s", type=float, default=0.15, help="between two sends of a burst")
    parser.add_argument("--queue-timeout-s", type=float, default=30.0, help="the proxy's queue_timeout_s")
    parser.add_argument("--swap-hold-s", type=float, default=None,
                        help="the proxy's swap_hold_s (default: its own default; 0: off)")
    parser.add_argument("--burst-timeout-s", type=float, default=120.0, help="a request's client-side limit")
    parser.add_argument("--oracle-max", type=int, default=8, help="the oracle for bursts up to this many requests")
    parser.add_argument("--calibration-rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=540.0, help="no new burst starts after this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
