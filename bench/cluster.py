"""Several machines, on one: demo boxes (real proxies on simulated cards) behind a small picker that scores
them as the Gateway API Inference Extension's endpoint picker does, on what each node's /metrics exports,
against round robin on the same stream.

Not a test: run `python bench/cluster.py` (3 boxes, 60 requests, seed 35: about a minute), or
`--nodes 2 --requests 30`. Each box is `proxy.demo.start_demo` on the `default` scenario (a 24 GiB card,
Ollama and ComfyUI), every port picked by the system, the watchdog on (it reads the card every
--watchdog-s), with the engines at --load-gbps (Ollama's and ComfyUI's loads from RAM) and their shipped
unload and free delays (0.8 s, 0.5 s). Both arms get fresh boxes (the test reuses two, emptied between the arms by `empty_cards`).

The stream (`mixed_stream`, seeded): chats for three models (llama3.1:8b 4.9 GB, qwen2.5:14b 9 GB,
gemma3:27b 16.2 GB: not all on one card, gemma with a render's checkpoint neither) and renders (SDXL,
6.5 GB, 20 steps), --render-share of them, Poisson arrivals --gap-s apart on average. A chat is an OpenAI
streamed chat completion (`POST /v1/chat/completions`, what the picker routes) to the chosen node's Ollama
listener; a render is ComfyUI's `POST /prompt`, then `GET /history/<id>` until done. Renders are not
OpenAI requests, so the Inference Extension does not route them: in both arms they are spread round robin
(as a plain Service would), and only the chats' routing differs:
- round robin: node after node;
- the residency-aware picker (`ResidencyPicker`): before each chat it scrapes every node's admin
  `/metrics` and scores the `ollama` tenant's series with the scorers the EndpointPickerConfig in
  examples/kubernetes/inference-pool.yaml names, at its weights (read from the file): lora-affinity
  (1 the model on the card, 0.8 room for one more, 0.6 on its way, else 0: from
  hyperswap_tenant_models_info), the endpoint-attribute scorer on hyperswap_tenant_memory_cost (1 - cost on
  a fixed 0-1 range; 0 without a sample), queue (the shortest 1, the longest 0, linear; all equal 1:
  hyperswap_tenant_requests_waiting); the highest weighted sum wins, ties at random (seeded), as the
  max-score picker does. The real picker scrapes on an interval (1 s in the config); this one scrapes at
  each decision, so it is the signals that are measured, not the scrape's age.

Per arm: model loads (the simulated Ollamas' own count), handoffs (plans that released a tenant, from each
proxy's decisions), each chat's time to first byte (send to the first byte of the streamed answer: the
wait for memory, the load and the first token) at p50 and p99, the renders' time to done, and every status.
Results: bench/results/cluster.json (or --out) and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from proxy.demo import Demo, comfy_prompt, start_demo  # noqa: E402
from proxy.sim.box import Scenario, fast_scenario, load_scenario  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"
POOL_MANIFEST = ROOT / "examples" / "kubernetes" / "inference-pool.yaml"
MODELS = ("llama3.1:8b", "qwen2.5:14b", "gemma3:27b")
CKPT = "sd_xl_base_1.0.safetensors"
TENANT = "ollama"  # the tenant the engineConfigs entry reads
POLL_S = 0.02
RENDER_STEPS = 20  # 0.4 s at the simulator's 20 ms a step


# -- what the picker reads from one node ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Endpoint:
    """One node's `ollama` series, as the picker's metrics extractor stores them."""
    waiting: int = 0
    running: int = 0
    memory_cost: float | None = None  # no sample: the attribute is missing
    active: frozenset[str] = frozenset()  # running_lora_adapters
    loading: frozenset[str] = frozenset()  # waiting_lora_adapters
    max_models: int = 0  # max_lora


def endpoint_from_metrics(text: str, tenant: str = TENANT) -> Endpoint:
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("tenant") != tenant:
                continue
            if s.name == "hyperswap_tenant_models_info":
                info = dict(s.labels)
            elif s.name.startswith("hyperswap_tenant_"):
                values[s.name] = s.value

    def names(csv: str) -> frozenset[str]:
        return frozenset(n.strip() for n in csv.split(",") if n.strip())

    return Endpoint(int(values.get("hyperswap_tenant_requests_waiting", 0)),
                    int(values.get("hyperswap_tenant_requests_running", 0)),
                    values.get("hyperswap_tenant_memory_cost"),
                    names(info.get("running_lora_adapters", "")), names(info.get("waiting_lora_adapters", "")),
                    int(info.get("max_lora", "0") or 0))


# -- the picker's scorers, as documented (llm-d router: scorer READMEs) ----------------------------------

def queue_scores(endpoints: Sequence[Endpoint]) -> list[float]:
    qs = [e.waiting for e in endpoints]
    low, high = min(qs), max(qs)
    return [1.0 if high == low else (high - q) / (high - low) for q in qs]


def affinity_scores(model: str, endpoints: Sequence[Endpoint]) -> list[float]:
    out = []
    for e in endpoints:
        if model in e.active:
            out.append(1.0)
        elif len(e.active) + len(e.loading) < e.max_models:
            out.append(0.8)
        elif model in e.loading:
            out.append(0.6)
        else:
            out.append(0.0)
    return out


def memory_scores(endpoints: Sequence[Endpoint]) -> list[float]:
    """endpoint-attribute-scorer, linear_lower_is_better on a fixed 0-1 range; a missing attribute scores 0."""
    return [0.0 if e.memory_cost is None else 1.0 - min(1.0, max(0.0, e.memory_cost)) for e in endpoints]


@dataclass(frozen=True, slots=True)
class Weights:
    affinity: float
    memory_cost: float
    queue: float


def weights_from_manifest(path: Path = POOL_MANIFEST) -> Weights:
    """The default profile's weights in the EndpointPickerConfig the manifests ship."""
    import yaml

    (cm,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ConfigMap"]
    config = yaml.safe_load(next(iter(cm["data"].values())))
    types = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    w = {types[r["pluginRef"]]: float(r.get("weight", 1.0)) for r in profile["plugins"] if "weight" in r}
    return Weights(w["lora-affinity-scorer"], w["endpoint-attribute-scorer"], w["queue-scorer"])


def pick(model: str, endpoints: Sequence[Endpoint], weights: Weights, rng: random.Random) -> int:
    """The index the max-score picker sends the request to."""
    total = [weights.affinity * a + weights.memory_cost * m + weights.queue * q
             for a, m, q in zip(affinity_scores(model, endpoints), memory_scores(endpoints), queue_scores(endpoints),
                                strict=True)]
    best = max(total)
    return rng.choice([i for i, t in enumerate(total) if abs(t - best) < 1e-9])


# -- routers ------------------------------------------------------------------------------------------------

class Router(Protocol):
    name: str

    async def choose(self, model: str, nodes: Sequence[Demo], http: httpx.AsyncClient) -> int: ...


@dataclass
class RoundRobin:
    name: str = "round robin"
    _next: int = 0

    async def choose(self, model: str, nodes: Sequence[Demo], http: httpx.AsyncClient) -> int:
        i = self._next % len(nodes)
        self._next += 1
        return i


@dataclass
class ResidencyPicker:
    weights: Weights
    seed: int = 35
    name: str = "residency-aware picker"
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def choose(self, model: str, nodes: Sequence[Demo], http: httpx.AsyncClient) -> int:
        texts = await asyncio.gather(*(http.get(admin(n) + "/metrics") for n in nodes))
        return pick(model, [endpoint_from_metrics(r.text) for r in texts], self.weights, self.rng)


# -- the stream and the cluster -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Request:
    kind: str  # "C" a chat, "R" a render
    model: str
    at_s: float


def mixed_stream(n: int, seed: int, gap_s: float, render_share: float, models: Sequence[str] = MODELS) -> list[Request]:
    """Chats for `models` (the first most asked for) and renders, Poisson arrivals `gap_s` apart on average."""
    rng = random.Random(seed)
    popularity = [len(models) - i for i in range(len(models))]
    out, t = [], 0.0
    for _ in range(n):
        if rng.random() < render_share:
            out.append(Request("R", CKPT, round(t, 3)))
        else:
            out.append(Request("C", rng.choices(list(models), popularity)[0], round(t, 3)))
        t += rng.expovariate(1 / gap_s) if gap_s > 0 else 0.0
    return out


def admin(node: Demo) -> str:
    return node.proxy.url("admin")  # type: ignore[union-attr]


def node_scenario(load_gbps: float, watchdog_s: float, fast: bool = False) -> Scenario:
    """The default box; `fast`: the engines at millisecond speeds (the test)."""
    if fast:
        return fast_scenario("default", settings={"proxy": {"watchdog_interval_s": watchdog_s}})
    data = load_scenario("default").model_dump()
    data["ollama"].update({"load_gbps": load_gbps, "disk_gbps": None})
    data["comfyui"].update({"load_gbps": load_gbps, "disk_gbps": None})
    data["settings"] = {"proxy": {"watchdog_interval_s": watchdog_s}}
    return Scenario.model_validate(data)


async def start_cluster(n: int, scenario: Scenario) -> list[Demo]:
    zero = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
    return list(await asyncio.gather(*(start_demo(scenario, sim_ports={"ollama": 0, "comfyui": 0, "relay": 0},
                                                  proxy_ports=zero, watchdog=True) for _ in range(n))))


@dataclass(slots=True)
class Outcome:
    kind: str
    model: str
    node: int
    status: int | str
    ttfb_s: float | None  # a chat: send to the first byte of its answer; a render: to POST /prompt's answer
    done_s: float | None  # send to the end (a render: its history says done)


async def _chat(node: Demo, model: str, http: httpx.AsyncClient) -> tuple[int | str, float | None, float]:
    url = node.proxy.url("ollama") + "/v1/chat/completions"  # type: ignore[union-attr]
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hello there"}]}
    t0 = time.monotonic()
    first = None
    async with http.stream("POST", url, json=body) as r:
        text = b""
        async for chunk in r.aiter_raw():
            if chunk and first is None:
                first = time.monotonic() - t0
            if r.status_code != 200 and len(text) < 300:
                text += chunk
        status: int | str = r.status_code if r.status_code == 200 else f"{r.status_code} {text[:300].decode(errors='replace')}"
        return status, first, time.monotonic() - t0


async def _render(node: Demo, http: httpx.AsyncClient, seed: int) -> tuple[int | str, float | None, float]:
    base = node.proxy.url("comfyui")  # type: ignore[union-attr]
    prompt: dict[str, Any] = comfy_prompt(CKPT, seed=seed)
    prompt["3"]["inputs"]["steps"] = RENDER_STEPS
    t0 = time.monotonic()
    r = await http.post(base + "/prompt", json={"prompt": prompt})
    ttfb = time.monotonic() - t0
    if r.status_code != 200:
        return r.status_code, ttfb, ttfb
    pid = r.json()["prompt_id"]
    while True:
        h = await http.get(f"{base}/history/{pid}")
        entry = h.json().get(pid) if h.status_code == 200 else None
        if entry and entry.get("status", {}).get("completed") is not None:
            ok = entry["status"].get("status_str") == "success"
            return (200 if ok else "failed"), ttfb, time.monotonic() - t0
        await asyncio.sleep(POLL_S)


async def run_stream(nodes: Sequence[Demo], stream: Sequence[Request], router: Router, *,
                     paced: bool = True, timeout_s: float = 120.0) -> list[Outcome]:
    """Send the stream (at its arrival times, or one after another when not `paced`); renders round robin."""
    outcomes: list[Outcome] = []
    renders = 0
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:
        async def one(req: Request, node: int, seed: int) -> None:
            try:
                if req.kind == "C":
                    status, ttfb, done = await _chat(nodes[node], req.model, http)
                else:
                    status, ttfb, done = await _render(nodes[node], http, seed)
            except httpx.HTTPError as exc:
                status, ttfb, done = f"{type(exc).__name__}", None, None
            outcomes.append(Outcome(req.kind, req.model, node, status, ttfb, done))

        tasks = []
        t0 = time.monotonic()
        for i, req in enumerate(stream):
            if paced:
                await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            if req.kind == "C":
                node = await router.choose(req.model, nodes, http)
            else:
                node, renders = renders % len(nodes), renders + 1
            task = asyncio.create_task(one(req, node, i))
            if paced:
                tasks.append(task)
            else:
                await task
        await asyncio.gather(*tasks)
    return outcomes


def loads(nodes: Sequence[Demo]) -> int:
    return sum(n.box.ollama.loads for n in nodes if n.box.ollama is not None)


def handoffs(nodes: Sequence[Demo]) -> int:
    return sum(1 for n in nodes if n.proxy is not None for d in n.proxy.decisions.recent(10_000)
               if d.kind in ("plan", "oom_retry", "spill") and d.outcome.get("releases"))


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass(slots=True)
class ArmResult:
    router: str
    loads: int
    handoffs: int
    chats: int
    renders: int
    ttfb_p50_s: float | None
    ttfb_p99_s: float | None
    render_done_p50_s: float | None
    not_ok: list[str]
    chats_per_node: list[int]


async def run_arm(router: Router, nodes: Sequence[Demo], stream: Sequence[Request], *, paced: bool = True) -> ArmResult:
    """The stream through `router` on `nodes` (fresh, or emptied by `empty_cards`): loads and handoffs counted
    from here on."""
    loads_before, handoffs_before = loads(nodes), handoffs(nodes)
    outcomes = await run_stream(nodes, stream, router, paced=paced)
    chats = [o for o in outcomes if o.kind == "C"]
    ttfb = [o.ttfb_s for o in chats if o.status == 200 and o.ttfb_s is not None]
    done = [o.done_s for o in outcomes if o.kind == "R" and o.status == 200 and o.done_s is not None]
    return ArmResult(router.name, loads(nodes) - loads_before, handoffs(nodes) - handoffs_before, len(chats),
                     len(outcomes) - len(chats), percentile(ttfb, 0.5), percentile(ttfb, 0.99), percentile(done, 0.5),
                     [f"{o.kind} {o.model} on {o.node}: {o.status}" for o in outcomes if o.status != 200],
                     [sum(1 for o in chats if o.node == i) for i in range(len(nodes))])


async def empty_cards(nodes: Sequence[Demo]) -> None:
    """Release every engine on every node through its admin API (each call returns once the card shows
    the memory back), so the next arm starts from empty cards."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for node in nodes:
            for tenant in ("ollama", "comfyui"):
                r = await http.post(f"{admin(node)}/api/tenants/{tenant}/release")
                if r.status_code != 200:
                    raise RuntimeError(f"release of {tenant}: {r.status_code} {r.text}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def table(results: Sequence[ArmResult]) -> str:
    lines = ["| routing | model loads | handoffs | chats | renders | TTFB p50 (ms) | TTFB p99 (ms) | render p50 (ms) | "
             "chats per node | not 200 |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        lines.append(f"| {r.router} | {r.loads} | {r.handoffs} | {r.chats} | {r.renders} | {_ms(r.ttfb_p50_s)} | "
                     f"{_ms(r.ttfb_p99_s)} | {_ms(r.render_done_p50_s)} | {'/'.join(map(str, r.chats_per_node))} | "
                     f"{len(r.not_ok)} |")
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--gap-s", type=float, default=0.4, help="mean time between arrivals")
    ap.add_argument("--render-share", type=float, default=0.25)
    ap.add_argument("--load-gbps", type=float, default=8.0, help="the engines' load speed (GB/s)")
    ap.add_argument("--watchdog-s", type=float, default=0.5, help="how often each proxy reads its card")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.requests < 1:
        ap.error("--nodes and --requests must be at least 1")
    scenario = node_scenario(args.load_gbps, args.watchdog_s)
    stream = mixed_stream(args.requests, args.seed, args.gap_s, args.render_share)
    weights = weights_from_manifest()
    results = []
    for router in (RoundRobin(), ResidencyPicker(weights, args.seed)):  # fresh boxes for each
        nodes = await start_cluster(args.nodes, scenario)
        try:
            results.append(await run_arm(router, nodes, stream))
        finally:
            await asyncio.gather(*(n.stop() for n in nodes))
        print(f"{router.name}: done", file=sys.stderr)
    print(table(results))
    for r in results:
        for line in r.not_ok:
            print(f"  {r.router}: {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"node": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "load_average": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: str(v) for k, v in vars(args).items()}, "weights": asdict(weights),
        "stream": [asdict(r) for r in stream], "results": [asdict(r) for r in results],
    }, indent=1) + "\n")
    print(f"written: {args.out}", file=sys.stderr)
    return 0 if all(not r.not_ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
