"""The HTTP side of `hyperswap verify`: the admin API, and the engines as a client sees them
through the proxy's drop-in listeners. Every call goes through an injected `httpx.AsyncClient`
(tests hand in one over a fake transport) and websockets through an injected connector."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from websockets.asyncio.client import connect as ws_connect

from proxy.admin.address import local_url
from proxy.clock import Clock
from proxy.config.units import GIB
from proxy.encoding import JSONObject, as_object
from proxy.handoff.decision_json import Decision
from proxy.handoff.plan_json import Plan


class WsConnection(Protocol):
    async def recv(self) -> str | bytes: ...


WsConnect = Callable[[str], AbstractAsyncContextManager[WsConnection]]


def default_ws_connect(url: str) -> AbstractAsyncContextManager[WsConnection]:
    return ws_connect(url, max_size=None, ping_interval=None, open_timeout=5.0, close_timeout=1.0)


class Unexpected(Exception):
    """An answer that is not what the engine or the proxy documents: status and a short body."""

    def __init__(self, what: str, response: httpx.Response) -> None:
        self.status = response.status_code
        self.body = _body(response)
        super().__init__(f"{what} answered {self.status}: {self.error_text()}")

    def error_text(self) -> str:
        error = as_object(self.body).get("error")
        if isinstance(error, str):
            return error[:300]
        return (self.body if isinstance(self.body, str) else json.dumps(self.body))[:300]

    def fix(self) -> str | None:
        fix = as_object(self.body).get("fix")
        return str(fix) if fix else None


def _body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text


def gib(n: object) -> str:
    """Bytes as GiB; "unknown" for a figure nobody gave (None, or not a number)."""
    return f"{n / GIB:.2f} GiB" if isinstance(n, int | float) and not isinstance(n, bool) else "unknown"


def gb_bytes(value: object) -> int:
    """A tenants.json `_gb` figure as bytes; 0 when it is not set."""
    return int(float(value) * GIB) if isinstance(value, int | float | str) and value else 0


def number(value: object) -> int | None:
    """A figure of a JSON answer as an int; None when it is not a number."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class TenantInfo:
    """One tenant as the admin API shows it, reduced to what the stages read."""
    name: str
    engine: str
    url: str | None  # its listener, where clients reach the engine through the proxy
    upstream: str | None
    reclaimable: bool
    busy: bool
    busy_reason: str
    vram_bytes: int | None
    needs_vram_bytes: int
    context_allowance_bytes: int
    idle_release_in_s: float | None
    config: JSONObject = field(default_factory=dict)

    @classmethod
    def from_json(cls, view: Mapping[str, object]) -> TenantInfo:
        cfg = as_object(view.get("config"))
        listen, listening, upstream = cfg.get("listen"), view.get("listening"), cfg.get("upstream")
        url = listening if isinstance(listening, str) and listening else (local_url(listen) if isinstance(listen, str)
                                                                            and listen else None)
        vram, idle_in = view.get("vram_bytes"), view.get("idle_release_in_s")
        busy = bool(view.get("busy")) or bool(view.get("in_flight")) or bool(view.get("waiting"))
        return cls(name=str(view["name"]), engine=str(cfg.get("engine", "generic")), url=url,
                   upstream=upstream if isinstance(upstream, str) else None, reclaimable=bool(view.get("reclaimable")),
                   busy=busy,
                   busy_reason=str(view.get("busy_reason") or ("requests in flight" if busy else "idle")),
                   vram_bytes=number(vram), needs_vram_bytes=gb_bytes(cfg.get("needs_vram_gb")),
                   context_allowance_bytes=gb_bytes(cfg.get("context_allowance_gb")),
                   idle_release_in_s=float(idle_in) if isinstance(idle_in, int | float) else None, config=cfg)


class AdminClient:
    def __init__(self, base: str, http: httpx.AsyncClient) -> None:
        self.base = base.rstrip("/")
        self.http = http

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> JSONObject:
        r = await self.http.get(self.base + path, params=params)
        if r.status_code != 200:
            raise Unexpected(f"GET {path}", r)
        body = r.json()
        if not isinstance(body, dict):
            raise ValueError(f"GET {path} answered {type(body).__name__}, not a JSON object")
        return as_object(body)

    async def tenants(self) -> list[TenantInfo]:
        views = (await self._get("/api/tenants"))["tenants"]
        return [TenantInfo.from_json(as_object(v)) for v in views] if isinstance(views, list) else []

    async def tenant(self, name: str) -> TenantInfo:
        return TenantInfo.from_json(await self._get(f"/api/tenants/{name}"))

    async def stats(self) -> JSONObject:
        return await self._get("/api/stats")

    async def plan(self, tenant: str, need_bytes: int | None = None) -> Plan:
        params = {"tenant": tenant}
        if need_bytes is not None:
            params["need_gb"] = f"{need_bytes / GIB:.4f}"
        return Plan.model_validate((await self._get("/api/plan", params))["plan"])

    async def decisions(self, limit: int = 200) -> list[Decision]:
        found = (await self._get("/api/decisions", {"limit": str(limit)}))["decisions"]
        return [Decision.model_validate(d) for d in found] if isinstance(found, list) else []

    async def release(self, tenant: str) -> None:
        r = await self.http.post(f"{self.base}/api/tenants/{tenant}/release")
        if r.status_code != 200:
            raise Unexpected(f"POST /api/tenants/{tenant}/release", r)


# -- Ollama through its listener ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class OllamaModel:
    name: str
    size: int


class OllamaClient:
    def __init__(self, base: str, http: httpx.AsyncClient) -> None:
        self.base = base
        self.http = http

    async def models(self) -> list[OllamaModel]:
        r = await self.http.get(self.base + "/api/tags")
        if r.status_code != 200:
            raise Unexpected("GET /api/tags", r)
        return sorted((OllamaModel(str(m["name"]), int(m["size"])) for m in r.json().get("models") or []),
                      key=lambda m: (m.size, m.name))

    async def capabilities(self, model: str) -> list[str] | None:
        """/api/show's capabilities ("completion", "embedding", ...); None from an Ollama too old to list them."""
        r = await self.http.post(self.base + "/api/show", json={"model": model})
        caps = r.json().get("capabilities") if r.status_code == 200 else None
        return [str(c) for c in caps] if isinstance(caps, list) else None

    async def can_generate(self, model: str) -> bool:
        """From /api/show's capabilities; an Ollama too old to list them is given the benefit of the doubt."""
        caps = await self.capabilities(model)
        return caps is None or "completion" in caps

    async def loaded(self) -> dict[str, int]:
        """Model -> size_vram of what Ollama holds now."""
        r = await self.http.get(self.base + "/api/ps")
        if r.status_code != 200:
            raise Unexpected("GET /api/ps", r)
        return {str(m["name"]): int(m.get("size_vram") or 0) for m in r.json().get("models") or []}

    async def generate(self, model: str, num_predict: int = 8) -> JSONObject:
        r = await self.http.post(self.base + "/api/generate", json={
            "model": model, "prompt": "Say hello in one word.", "stream": False, "options": {"num_predict": num_predict}})
        if r.status_code != 200:
            raise Unexpected(f"POST /api/generate ({model})", r)
        return as_object(r.json())

    async def load(self, model: str) -> str:
        """Load a model without a prompt, the way its kind allows: a generate call with no prompt, or for
        an embedding-only model (which answers a generate call with 400) an embed call with no input.
        Returns the call made."""
        caps = await self.capabilities(model)
        if caps is not None and "completion" not in caps and "embedding" in caps:
            call, body = "/api/embed", {"model": model, "input": []}
        else:
            call, body = "/api/generate", {"model": model}
        r = await self.http.post(self.base + call, json=body)
        if r.status_code != 200:
            raise Unexpected(f"loading {model} (POST {call})", r)
        return call

    async def unload(self, model: str) -> None:
        r = await self.http.post(self.base + "/api/generate", json={"model": model, "keep_alive": 0})
        if r.status_code != 200:
            raise Unexpected(f"unloading {model}", r)


# -- ComfyUI through its listener ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GraphRun:
    prompt_id: str
    ok: bool
    error_type: str | None  # execution_error's exception_type
    error: str | None
    followed: str  # "websocket" or "history"


def _combo(spec: object) -> list[str]:
    """A combo input's options: V1 `[[...], {opts}]`, V3 `["COMBO", {"options": [...]}]`."""
    if isinstance(spec, list) and spec:
        if isinstance(spec[0], list):
            return [str(x) for x in spec[0]]
        if spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], dict):
            options = spec[1].get("options")
            return [str(x) for x in options] if isinstance(options, list) else []
    return []


MINIMAL_NODES = ("CheckpointLoaderSimple", "EmptyLatentImage", "CLIPTextEncode", "KSampler", "VAEDecode")


def minimal_graph(object_info: Mapping[str, object], checkpoint: str | None, seed: int) -> tuple[JSONObject, str]:
    """The smallest text-to-image graph the installed nodes allow: 64x64, one step, a preview (not
    saved to the output folder). Raises LookupError naming what is missing."""
    out_node = _output_node(object_info)
    ckpt = _checkpoint_to_load(object_info, checkpoint)
    sampler, scheduler = _sampler_and_scheduler(object_info)
    last: JSONObject = {"images": ["6", 0]}
    if out_node == "SaveImage":
        last["filename_prefix"] = "hyperswap-verify"
    graph: JSONObject = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "hyperswap verify", "clip": ["1", 1]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "5": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": 1, "cfg": 1.0, "denoise": 1.0,
            "sampler_name": sampler, "scheduler": scheduler,
            "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["2", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": out_node, "inputs": last},
    }
    return graph, ckpt


def _output_node(object_info: Mapping[str, object]) -> str:
    """The graph's last node, PreviewImage where installed, else SaveImage; LookupError naming the
    core nodes missing."""
    missing = [n for n in MINIMAL_NODES if n not in object_info]
    out_node = "PreviewImage" if "PreviewImage" in object_info else "SaveImage" if "SaveImage" in object_info else None
    if missing or out_node is None:
        raise LookupError(f"ComfyUI lacks the core node(s) {', '.join(missing or ['PreviewImage/SaveImage'])}")
    return out_node


def _required_inputs(object_info: Mapping[str, object], node: str) -> JSONObject:
    return as_object(as_object(as_object(object_info[node]).get("input")).get("required"))


def _checkpoint_to_load(object_info: Mapping[str, object], checkpoint: str | None) -> str:
    """The checkpoint asked for, else the first installed; LookupError if it is not installed or none is."""
    ckpts = _combo(_required_inputs(object_info, "CheckpointLoaderSimple").get("ckpt_name"))
    if checkpoint is not None and checkpoint not in ckpts:
        raise LookupError(f"no checkpoint {checkpoint!r} installed (ComfyUI lists {', '.join(ckpts) or 'none'})")
    if not ckpts:
        raise LookupError("ComfyUI lists no checkpoint (models/checkpoints is empty)")
    return checkpoint or ckpts[0]


def _sampler_and_scheduler(object_info: Mapping[str, object]) -> tuple[str, str]:
    """euler and normal where KSampler offers them, else the first it lists."""
    sampler_inputs = _required_inputs(object_info, "KSampler")
    samplers = _combo(sampler_inputs.get("sampler_name")) or ["euler"]
    schedulers = _combo(sampler_inputs.get("scheduler")) or ["normal"]
    return ("euler" if "euler" in samplers else samplers[0]), ("normal" if "normal" in schedulers else schedulers[0])


def the_graph(checkpoint: str | None) -> str:
    """A graph as the report names it: "the sd_xl_base_1.0.safetensors graph", never "the None graph"."""
    return f"the {checkpoint} graph" if checkpoint else "the graph without a checkpoint"


def graph_checkpoint(graph: Mapping[str, object]) -> str | None:
    for node in graph.values():
        ckpt = as_object(as_object(node).get("inputs")).get("ckpt_name")
        if isinstance(ckpt, str):
            return ckpt
    return None


class ComfyClient:
    def __init__(self, base: str, http: httpx.AsyncClient, ws: WsConnect, clock: Clock, poll_s: float = 0.1) -> None:
        self.base = base
        self.http = http
        self.ws = ws
        self.clock = clock
        self.poll_s = poll_s

    async def object_info(self) -> JSONObject:
        r = await self.http.get(self.base + "/object_info")
        if r.status_code != 200:
            raise Unexpected("GET /object_info", r)
        return as_object(r.json())

    async def submit(self, graph: Mapping[str, object], client_id: str) -> str:
        r = await self.http.post(self.base + "/prompt", json={"prompt": graph, "client_id": client_id})
        if r.status_code != 200:
            raise Unexpected("POST /prompt", r)
        return str(r.json()["prompt_id"])

    async def run(self, graph: Mapping[str, object]) -> GraphRun:
        """Queue the graph with a websocket open (as the UI does) and follow it to its end marker;
        without a websocket, poll /history. The caller bounds the wait."""
        cid = f"hyperswap-verify-{uuid.uuid4().hex[:12]}"
        ws_url = self.base.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + f"/ws?clientId={cid}"
        async with AsyncExitStack() as stack:
            ws: WsConnection | None
            try:
                ws = await stack.enter_async_context(self.ws(ws_url))
                await ws.recv()  # the status frame with our sid
            except Exception:  # no websocket through the proxy: /history still tells the end
                ws = None
            pid = await self.submit(graph, cid)
            if ws is None:
                return await self.wait_history(pid)
            return await self._follow_ws(ws, pid)

    async def _follow_ws(self, ws: WsConnection, pid: str) -> GraphRun:
        error_type = error = None
        while True:
            raw = await ws.recv()
            if isinstance(raw, bytes):
                continue
            m = json.loads(raw)
            data = m.get("data") or {}
            if data.get("prompt_id") != pid:
                continue
            if m.get("type") == "execution_error":
                error_type = str(data.get("exception_type"))
                message = str(data.get("exception_message") or error_type).strip()
                error = message.splitlines()[0].strip() if message else error_type
            if m.get("type") == "execution_interrupted":
                error_type, error = "interrupted", "the prompt was interrupted"
            if m.get("type") == "executing" and data.get("node") is None:
                return GraphRun(pid, error_type is None, error_type, error, "websocket")

    async def wait_history(self, pid: str) -> GraphRun:
        while True:
            r = await self.http.get(f"{self.base}/history/{pid}")
            entry = r.json().get(pid) if r.status_code == 200 else None
            status = (entry or {}).get("status") or {}
            if entry and status.get("completed") is not None and status.get("status_str") in ("success", "error"):
                error_type = error = None
                for kind, data in status.get("messages") or []:
                    if kind == "execution_error" and isinstance(data, dict):
                        error_type = str(data.get("exception_type"))
                        error = str(data.get("exception_message") or error_type).strip().splitlines()[0].strip()
                ok = status.get("status_str") == "success"
                return GraphRun(pid, ok, None if ok else error_type or "error", None if ok else error, "history")
            await self.clock.sleep(self.poll_s)
