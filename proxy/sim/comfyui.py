"""A simulated ComfyUI 0.8.0 server on a real loopback socket.

HTTP + websocket, one prompt worker, smart-memory model residency in a SimulatedGpu, /free applied by
the worker (when idle or right after the running prompt) with the memory coming back free_delay_s
later, OOM as execution_error with the automatic unload. See proxy/sim/README.md for what is
modelled and what is not.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketClose, WebSocketDisconnect

from proxy.clock import Clock, SystemClock
from proxy.relay.servers import RunningServer, start_server
from proxy.sim.comfyui_jobs import BadQuery, find_job, list_jobs, parse_query
from proxy.sim.comfyui_nodes import Accepted, NodeClass, Rejected, Unhandled, catalogue, dependencies, execution_order, validate
from proxy.sim.comfyui_userdata import BadJson, UserData, raw_segment
from proxy.sim.comfyui_wire import AIOHTTP_500, FAKE_JPEG, AiohttpHeaders, OriginAndSizeMiddleware, parse_multipart, png_bytes
from proxy.sim.gpu import SimulatedCard, SimulatedOutOfMemory
from proxy.sim.model_files import SimModelFiles, load_seconds

GIB = 2**30
# What a 0.8.0 install reports: its requirements.txt pins (frontend 1.35.9 from v0.7.0 to v0.8.2;
# templates: v0.7.0's pin, see README) and the torch the observed server ran (2.9.1; the CUDA wheel).
FRONTEND_VERSION = "1.35.9"
TEMPLATES_VERSION = "0.7.64"
TORCH_VERSION = "2.9.1+cu128"
JSON = dict[str, Any]
ProgressFn = Callable[[str, float, float, str], None]  # (node id, value, max, state) -> progress_state

OOM_MESSAGE = ("Allocation on device \nThis error means you ran out of memory on your GPU.\n\n"
               "TIPS: If the workflow worked before you might have accidentally set the batch_size to a large number.")
MODEL_FOLDERS = ["checkpoints", "configs", "loras", "vae", "text_encoders", "diffusion_models", "clip_vision",
                 "style_models", "embeddings", "diffusers", "vae_approx", "controlnet", "gligen", "upscale_models",
                 "latent_upscale_models", "custom_nodes", "hypernetworks", "photomaker", "classifiers", "model_patches",
                 "audio_encoders"]
DEFAULT_DEVICE_NAME = "cuda:0 Simulated RTX 4090 : cudaMallocAsync"
# Binary websocket event types (protocol.py): 4-byte big-endian type, then the payload.
PREVIEW_IMAGE = 1
PREVIEW_IMAGE_WITH_METADATA = 4
_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"]
SENSITIVE_EXTRA_DATA_KEYS = ("auth_token_comfy_org", "api_key_comfy_org")
_INDEX_HTML = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"UTF-8\"><title>ComfyUI</title></head>"
               "<body><div id=\"vue-app\"></div><p>Simulated ComfyUI</p></body></html>\n")


@dataclass(frozen=True, slots=True)
class ComfySimConfig:
    checkpoints: dict[str, int] = field(default_factory=lambda: {"sd_xl_base_1.0.safetensors": 7 * GIB})
    context_floor_bytes: int = int(0.4 * GIB)   # CUDA context, held while the process lives
    step_time_s: float = 0.02                   # per KSampler step
    working_bytes: int = int(1.5 * GIB)         # held while sampling, released after
    free_delay_s: float = 0.3                   # between the worker acting on /free and the memory coming back
    load_gbps: float = 4.0                      # GiB/s to VRAM (from the page cache, when disk_gbps is set)
    disk_gbps: float | None = None              # GiB/s from disk: load time follows the file's residency
    stale_running_entry: bool = False
    version: str = "0.8.0"
    argv: tuple[str, ...] = ("main.py",)
    max_upload_size_mb: float = 100.0
    device_name: str = DEFAULT_DEVICE_NAME
    previews: bool = False

    @classmethod
    def from_scenario(cls, section: dict[str, Any]) -> ComfySimConfig:
        """The "comfyui" object of a scenario JSON; sizes are GiB floats. Unknown keys are an error."""
        try:
            s = _ScenarioSection.model_validate(section)
        except ValidationError as exc:
            raise ValueError(f"invalid comfyui scenario section: {exc}") from exc
        base = cls()
        return cls(
            checkpoints={k: int(v * GIB) for k, v in s.checkpoints.items()} if s.checkpoints is not None
            else dict(base.checkpoints),
            context_floor_bytes=int(s.context_floor_gb * GIB) if s.context_floor_gb is not None else base.context_floor_bytes,
            step_time_s=base.step_time_s if s.step_time_s is None else s.step_time_s,
            working_bytes=int(s.working_gb * GIB) if s.working_gb is not None else base.working_bytes,
            free_delay_s=base.free_delay_s if s.free_delay_s is None else s.free_delay_s,
            load_gbps=base.load_gbps if s.load_gbps is None else s.load_gbps,
            disk_gbps=s.disk_gbps,
            stale_running_entry=s.stale_running_entry,
            version=s.version or base.version,
            argv=tuple(s.argv) if s.argv is not None else base.argv,
            max_upload_size_mb=base.max_upload_size_mb if s.max_upload_size_mb is None else s.max_upload_size_mb,
            device_name=s.device_name or base.device_name,
            previews=s.previews,
        )


class _ScenarioSection(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)
    checkpoints: dict[str, float] | None = None
    context_floor_gb: float | None = None
    step_time_s: float | None = None
    working_gb: float | None = None
    free_delay_s: float | None = None
    load_gbps: float | None = None
    disk_gbps: float | None = Field(None, gt=0)
    stale_running_entry: bool = False
    version: str | None = None
    argv: list[str] | None = None
    max_upload_size_mb: float | None = None
    device_name: str | None = None
    previews: bool = False


@dataclass(slots=True)
class _Item:
    number: int | float
    prompt_id: str
    graph: JSON
    extra_data: JSON
    outputs: list[str]

    def wire(self) -> list[Any]:
        return [self.number, self.prompt_id, self.graph, self.extra_data, self.outputs]


@dataclass(slots=True)
class _Client:
    sid: str
    outbox: asyncio.Queue[str | bytes]
    preview_metadata: bool = False


class _Interrupted(Exception):
    def __init__(self, node_id: str, node_type: str) -> None:
        super().__init__(node_id)
        self.node_id, self.node_type = node_id, node_type


class _OutOfMemory(Exception):
    pass


class _BadBody(Exception):
    """Invalid JSON where aiohttp's request.json() would raise: an unhandled 500."""


def _dumps(data: Any) -> str:
    return json.dumps(data)  # Python's default separators, like aiohttp's json_response/send_json


def _json(data: Any, status: int = 200) -> Response:
    return Response(_dumps(data), status_code=status, media_type="application/json; charset=utf-8")


def _ms() -> int:
    return int(time.time() * 1000)


class ComfySim:
    def __init__(self, gpu: SimulatedCard, config: ComfySimConfig, *, clock: Clock | None = None) -> None:
        self.gpu = gpu
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.pid: int | None = None
        self.frees = 0
        self.executed = 0
        self.accepted = 0  # prompts POST /prompt queued (the proxy let them through)
        self._server: RunningServer | None = None
        self._worker: asyncio.Task[None] | None = None
        self._timers: set[asyncio.Task[None]] = set()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.base_dir = Path()
        self.files: SimModelFiles | None = None  # real stand-in files: load times follow their residency
        self._classes: dict[str, NodeClass] = catalogue(sorted(config.checkpoints))
        self._sockets: dict[str, _Client] = {}
        self._heap: list[tuple[int | float, str, int, _Item]] = []
        self._seq = itertools.count()
        self._running: dict[str, _Item] = {}
        self._history: dict[str, JSON] = {}
        self._number = 0
        self._wake = asyncio.Event()
        self._free_flags: dict[str, bool] = {}
        self._interrupt = False
        self._oom_left = 0  # how many of the next KSamplers or checkpoint loads run out of memory
        self._loaded: dict[str, int] = {}
        self.checkpoint_loads = 0  # checkpoints read onto the card (a restore after a suspend reads none)
        self._torch_cache = 0        # reserved but inactive bytes (freed models awaiting empty_cache)
        self._node_cache: dict[tuple[str, str], JSON | None] = {}  # (node id, input signature) -> ui output
        self._current_client: str | None = None
        self._current_node: str | None = None
        self.stale_prompt_id: str | None = None   # the stuck queue_running row (stale_running_entry)
        self.app = self._build_app()

    # -- observables ----------------------------------------------------------------------
    def loaded(self) -> dict[str, int]:
        """Checkpoints whose weights are in VRAM now (name -> bytes)."""
        return dict(self._loaded)

    def fail_next_prompt_with_oom(self, times: int = 1) -> None:
        """The next KSampler or checkpoint load that executes raises torch.OutOfMemoryError (the next
        `times` of them: each ends its prompt; 0 takes back what is left)."""
        self._oom_left = times

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def device_name(self) -> str:
        """The configured name, or (left at the default) one built from the simulated GPU's name."""
        if self.config.device_name == DEFAULT_DEVICE_NAME and self.gpu.name != "Simulated RTX 4090":
            return f"cuda:0 {self.gpu.name} : cudaMallocAsync"
        return self.config.device_name

    @property
    def highvram(self) -> bool:
        return "--highvram" in self.config.argv or "--gpu-only" in self.config.argv

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
        self._tmp = tempfile.TemporaryDirectory(prefix="comfysim-")
        self.base_dir = Path(self._tmp.name)
        for sub in ("output", "input", "temp"):
            (self.base_dir / sub).mkdir()
        (self.base_dir / "user").mkdir()  # UserManager makes the user directory at start
        self._wake = asyncio.Event()
        self._server = await start_server(self.app, host, port, name="comfyui-sim")
        extra = " ".join(a for a in self.config.argv[1:])
        cmdline = f"python3 /opt/ComfyUI/main.py --listen {host} --port {self._server.port}" + (f" {extra}" if extra else "")
        self.pid = self.gpu.spawn("python3", cmdline, self.config.context_floor_bytes)
        if self.config.stale_running_entry:
            self._add_ghost()
        self._worker = asyncio.create_task(self._work(), name="comfyui-sim-worker")
        return self._server

    async def stop(self) -> None:
        tasks = [t for t in (self._worker, *self._timers) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._worker = None
        self._timers.clear()
        if self._server is not None:
            await self._server.stop()
            self._server = None
        if self.pid is not None:
            self.gpu.kill(self.pid)
            self.pid = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _add_ghost(self) -> None:
        """A UI row stuck in queue_running: an entry left in currently_running whose execution is gone
        (the worker moved on). It never finishes and holds nothing beyond the context floor."""
        prompt_id = str(uuid.uuid4())
        graph = {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
                 "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "ComfyUI"}}}
        extra_data = {"client_id": uuid.uuid4().hex, "create_time": _ms()}
        self._running[prompt_id] = _Item(self._number, prompt_id, graph, extra_data, ["2"])
        self._number += 1
        self.stale_prompt_id = prompt_id

    # -- websocket fan-out ------------------------------------------------------------------
    def _queue_remaining(self) -> int:
        return len(self._heap) + len(self._running)

    def _send(self, event: str, data: JSON, sid: str | None) -> None:
        """send_sync(): to one socket, or to all when sid is None. Ordered through each socket's outbox."""
        text = _dumps({"type": event, "data": data})
        targets = self._sockets.values() if sid is None else [c for c in (self._sockets.get(sid),) if c]
        for client in targets:
            client.outbox.put_nowait(text)

    def _broadcast_status(self) -> None:
        self._send("status", {"status": {"exec_info": {"queue_remaining": self._queue_remaining()}}}, None)

    def _send_bytes(self, frame: bytes, sid: str | None) -> None:
        targets = self._sockets.values() if sid is None else [c for c in (self._sockets.get(sid),) if c]
        for client in targets:
            client.outbox.put_nowait(frame)

    def _wants_metadata(self, sid: str | None) -> bool:
        """feature_flags.supports_feature() for the prompt's owner; an ownerless prompt never has it."""
        client = self._sockets.get(sid) if sid is not None else None
        return client is not None and client.preview_metadata

    def _report(self, nid: str, value: int | float, maximum: int | float, prompt_id: str, cid: str | None,
                progress_state: ProgressFn, image: tuple[str, bytes] | None = None) -> None:
        """main.py's progress hook: progress_state, a type-4 image for an owner that negotiated preview
        metadata, progress, then the plain type-1 image for an owner that did not (or everyone)."""
        progress_state(nid, value, maximum, "running")
        metadata = self._wants_metadata(cid)
        if image is not None and metadata:
            self._send_bytes(_image_with_metadata(image, nid, prompt_id), cid)
        self._send("progress", {"value": value, "max": maximum, "prompt_id": prompt_id, "node": nid}, cid)
        if image is not None and not metadata:
            self._send_bytes(_plain_image(image), cid)

    async def _ws(self, websocket: WebSocket) -> None:
        await websocket.accept()
        sid = websocket.query_params.get("clientId") or uuid.uuid4().hex
        client = _Client(sid, asyncio.Queue())
        self._sockets[sid] = client  # a previous socket with this id leaves the routing table, stays open
        client.outbox.put_nowait(_dumps({"type": "status", "data": {
            "status": {"exec_info": {"queue_remaining": self._queue_remaining()}}, "sid": sid}}))
        if self._current_client == sid and self._current_node is not None:
            client.outbox.put_nowait(_dumps({"type": "executing", "data": {"node": self._current_node}}))
        pump = asyncio.create_task(self._pump(websocket, client))
        try:
            first = True
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if first and message.get("text"):
                    self._feature_flags(client, message["text"])
                first = False
        except WebSocketDisconnect:
            pass
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            if self._sockets.get(sid) is client:
                del self._sockets[sid]

    def _feature_flags(self, client: _Client, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return
        if isinstance(message, dict) and message.get("type") == "feature_flags" and isinstance(message.get("data"), dict):
            client.preview_metadata = bool(message["data"].get("supports_preview_metadata"))
            client.outbox.put_nowait(_dumps({"type": "feature_flags", "data": self._features()}))

    @staticmethod
    async def _pump(websocket: WebSocket, client: _Client) -> None:
        while True:
            frame = await client.outbox.get()
            try:
                if isinstance(frame, bytes):
                    await websocket.send_bytes(frame)
                else:
                    await websocket.send_text(frame)
            except Exception:  # the socket went away; the receive side notices and cleans up
                return

    # -- memory ----------------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> None:
        """Reuse torch's cache first, then ask the device (raises SimulatedOutOfMemory)."""
        assert self.pid is not None
        from_cache = min(self._torch_cache, nbytes)
        if nbytes > from_cache:
            self.gpu.allocate(self.pid, nbytes - from_cache)
        self._torch_cache -= from_cache

    def _release_now(self, nbytes: int) -> None:
        if self.pid is not None:
            self.gpu.release(self.pid, nbytes)

    def _unload_all_now(self) -> None:
        """OOM path: unload_all_models() + soft_empty_cache(): back to the context floor at once."""
        self._loaded.clear()
        self._torch_cache = 0
        if self.pid is not None:
            self.gpu.set_used(self.pid, self.config.context_floor_bytes)

    async def _ensure_loaded(self, name: str, node_id: str, node_type: str) -> None:
        if self.pid is not None:
            await self.gpu.cuda_ready(self.pid)  # suspended (cuda_suspend): its CUDA calls block until the restore
        if name in self._loaded:
            return
        for other, size in list(self._loaded.items()):  # smart memory: make room by unloading the others
            del self._loaded[other]
            self._release_now(size)
        size = self.config.checkpoints[name]
        try:
            self._check_oom()
            self._allocate(size)
        except SimulatedOutOfMemory as exc:
            raise _OutOfMemory(node_id, node_type) from exc
        await self.clock.sleep(self._load_seconds(name, size))
        self._loaded[name] = size
        self.checkpoint_loads += 1

    def _load_seconds(self, name: str, size: int) -> float:
        files, disk = self.files, self.config.disk_gbps
        if files is None or disk is None:
            return load_seconds(size, 1.0, self.config.load_gbps, None, GIB)
        path = files.comfy_checkpoint(name)
        resident = files.resident(path)
        files.engine_read(path)
        return load_seconds(size, resident, self.config.load_gbps, disk, GIB)

    def _check_oom(self) -> None:
        if self._oom_left > 0:
            self._oom_left -= 1
            raise SimulatedOutOfMemory(0, 0)

    def _apply_free(self) -> None:
        """The worker's flag handling (main.py): free_memory implies unload; free_memory drops caches."""
        flags, self._free_flags = self._free_flags, {}
        free_memory = flags.get("free_memory", False)
        unload = flags.get("unload_models", free_memory)
        if unload and not (self.highvram and not free_memory):
            # Weights leave VRAM (to CPU RAM); torch keeps the blocks reserved until empty_cache.
            self._torch_cache += sum(self._loaded.values())
            self._loaded.clear()
        if free_memory:
            self._node_cache.clear()
        if self._torch_cache:
            task = asyncio.create_task(self._empty_cache_later())
            self._timers.add(task)
            task.add_done_callback(self._timers.discard)

    async def _empty_cache_later(self) -> None:
        await self.clock.sleep(self.config.free_delay_s)
        cached, self._torch_cache = self._torch_cache, 0
        self._release_now(cached)

    # -- the prompt worker -------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            while not self._heap and not self._free_flags:
                self._wake.clear()
                await self._wake.wait()
            if self._heap:
                _, _, _, item = heapq.heappop(self._heap)
                self._running[item.prompt_id] = item
                self._broadcast_status()
                await self._execute(item)
            if self._free_flags:
                self._apply_free()

    async def _execute(self, item: _Item) -> None:
        self._interrupt = False  # an interrupt sent while idle is dropped
        prompt_id, graph = item.prompt_id, item.graph
        cid: str | None = item.extra_data.get("client_id")
        self._current_client = cid
        messages: list[list[Any]] = []

        def add_message(event: str, data: JSON, broadcast: bool) -> None:
            messages.append([event, data])
            if cid is not None or broadcast:
                self._send(event, data, cid)

        states: dict[str, JSON] = {}

        def progress_state(nid: str, value: float, maximum: float, state: str) -> None:
            states[nid] = {"value": value, "max": maximum, "state": state, "node_id": nid, "prompt_id": prompt_id,
                           "display_node_id": nid, "parent_node_id": None, "real_node_id": nid}
            self._send("progress_state", {"prompt_id": prompt_id, "nodes": dict(states)}, cid)

        def targeted(event: str, data: JSON) -> None:
            if cid is not None:
                self._send(event, data, cid)

        signatures = _signatures(graph)
        add_message("execution_start", {"prompt_id": prompt_id, "timestamp": _ms()}, False)
        cached = [nid for nid in graph if (nid, signatures[nid]) in self._node_cache]
        add_message("execution_cached", {"nodes": cached, "prompt_id": prompt_id, "timestamp": _ms()}, False)
        reached: set[str] = set()
        stack = list(item.outputs)
        while stack:
            nid = stack.pop()
            if nid not in reached:
                reached.add(nid)
                if nid not in cached:
                    stack.extend(dependencies(graph, nid))
        order = [nid for nid in execution_order(graph, tuple(item.outputs)) if nid in reached]
        executed: list[str] = []
        outputs: JSON = {}
        meta: JSON = {}
        ok = False
        try:
            for nid in order:
                node_type = graph[nid]["class_type"]
                key = (nid, signatures[nid])
                if key in self._node_cache:
                    ui = self._node_cache[key]
                    targeted("executed", {"node": nid, "display_node": nid, "output": ui, "prompt_id": prompt_id})
                    if ui is not None:
                        outputs[nid] = ui
                        meta[nid] = _meta(nid)
                    progress_state(nid, 1, 1, "finished")
                    executed.append(nid)
                    continue
                progress_state(nid, 0.0, 1.0, "running")
                targeted("executing", {"node": nid, "display_node": nid, "prompt_id": prompt_id})
                self._current_node = nid
                if self._interrupt:
                    raise _Interrupted(nid, node_type)
                ui, done_max = await self._run_node(nid, graph, prompt_id, cid, progress_state)
                if ui is not None:
                    targeted("executed", {"node": nid, "display_node": nid, "output": ui, "prompt_id": prompt_id})
                    outputs[nid] = ui
                    meta[nid] = _meta(nid)
                progress_state(nid, done_max, done_max, "finished")
                self._node_cache[key] = ui
                executed.append(nid)
            add_message("execution_success", {"prompt_id": prompt_id, "timestamp": _ms()}, False)
            ok = True
        except _Interrupted as exc:
            add_message("execution_interrupted", {"prompt_id": prompt_id, "node_id": exc.node_id,
                                                  "node_type": exc.node_type, "executed": executed,
                                                  "timestamp": _ms()}, True)
        except _OutOfMemory as exc:
            node_id, node_type = exc.args
            self._unload_all_now()  # "Got an OOM, unloading all loaded models."
            add_message("execution_error", {
                "prompt_id": prompt_id, "node_id": node_id, "node_type": node_type, "executed": executed,
                "exception_message": OOM_MESSAGE, "exception_type": "torch.OutOfMemoryError",
                "traceback": _oom_traceback(node_type),
                "current_inputs": _format_inputs(graph[node_id].get("inputs") or {}),
                "current_outputs": list(graph), "timestamp": _ms()}, False)
        finally:
            self._current_node = None
            self._current_client = None
        self.executed += 1
        self._history[prompt_id] = {
            "prompt": item.wire(), "outputs": outputs,
            "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": messages},
            "meta": meta}
        while len(self._history) > 10_000:
            del self._history[next(iter(self._history))]
        del self._running[prompt_id]
        self._broadcast_status()
        targeted("executing", {"node": None, "prompt_id": prompt_id})

    async def _run_node(self, nid: str, graph: JSON, prompt_id: str, cid: str | None,
                        progress_state: ProgressFn) -> tuple[JSON | None, float]:
        """Execute one node; returns (ui output or None, the progress max it finished at)."""
        node = graph[nid]
        kind, inputs = node["class_type"], node.get("inputs") or {}
        if kind == "CheckpointLoaderSimple":
            await self._ensure_loaded(inputs["ckpt_name"], nid, kind)
            return None, 1.0
        if kind == "KSampler":
            return None, await self._sample(nid, graph, prompt_id, cid, progress_state)
        if kind in ("SaveImage", "PreviewImage"):
            return {"images": [self._save(kind, inputs)]}, 1.0
        if kind == "SaveImageWebsocket":
            return None, await self._send_images(nid, graph, prompt_id, cid, progress_state)
        await asyncio.sleep(0)
        return None, 1.0

    async def _sample(self, nid: str, graph: JSON, prompt_id: str, cid: str | None,
                      progress_state: ProgressFn) -> int:
        ckpt = _upstream_checkpoint(graph, nid)
        if self.pid is not None:
            await self.gpu.cuda_ready(self.pid)
        if ckpt is not None:
            await self._ensure_loaded(ckpt, nid, "KSampler")  # load_models_gpu() if /free moved it out
        try:
            self._check_oom()
            self._allocate(self.config.working_bytes)
        except SimulatedOutOfMemory as exc:
            raise _OutOfMemory(nid, "KSampler") from exc
        steps = int(graph[nid]["inputs"].get("steps", 20))
        try:
            for step in range(1, steps + 1):
                await self.clock.sleep(self.config.step_time_s)
                if self._interrupt:  # the sampler callback checks the flag every step
                    raise _Interrupted(nid, "KSampler")
                preview = ("JPEG", FAKE_JPEG) if self.config.previews else None
                self._report(nid, step, steps, prompt_id, cid, progress_state, preview)
        finally:
            self._release_now(self.config.working_bytes)
        return steps

    async def _send_images(self, nid: str, graph: JSON, prompt_id: str, cid: str | None,
                           progress_state: ProgressFn) -> int:
        """SaveImageWebsocket: each image of the batch as a PNG through the progress bar (no files, no
        UI output, so no "executed"); progress counts 0 .. batch-1 and the node finishes at the batch size."""
        batch = _batch_size(graph, nid)
        for step in range(batch):
            if self._interrupt:  # the progress hook checks the flag
                raise _Interrupted(nid, "SaveImageWebsocket")
            self._report(nid, step, batch, prompt_id, cid, progress_state, ("PNG", png_bytes()))
            await asyncio.sleep(0)
        return batch

    def _save(self, kind: str, inputs: JSON) -> JSON:
        if kind == "SaveImage":
            folder, kind_name = self.base_dir / "output", "output"
            prefix = str(inputs.get("filename_prefix", "ComfyUI"))
        else:
            folder, kind_name = self.base_dir / "temp", "temp"
            prefix = "ComfyUI_temp_" + uuid.uuid4().hex[:5]
        subfolder, _, name = prefix.rpartition("/")
        target = folder / subfolder
        target.mkdir(parents=True, exist_ok=True)
        taken = [p.name for p in target.glob(f"{name}_*_.png")]
        counter = 1 + max((int(n[len(name) + 1:-5]) for n in taken if n[len(name) + 1:-5].isdigit()), default=0)
        filename = f"{name}_{counter:05}_.png"
        (target / filename).write_bytes(png_bytes())
        return {"filename": filename, "subfolder": subfolder, "type": kind_name}

    # -- HTTP --------------------------------------------------------------------------------
    def _features(self) -> JSON:
        return {"supports_preview_metadata": True, "max_upload_size": int(self.config.max_upload_size_mb * 1024 * 1024),
                "extension": {"manager": {"supports_v4": True}}}

    async def _read_json(self, request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except ValueError as exc:
            raise _BadBody() from exc

    async def _index(self, request: Request) -> Response:
        # A real ComfyUI 0.8.0 types its index `text/html`, no charset (issue 36); Starlette's
        # HTMLResponse would add "; charset=utf-8".
        return Response(_INDEX_HTML.encode(), headers={"content-type": "text/html"})

    async def _get_prompt(self, request: Request) -> Response:
        return _json({"exec_info": {"queue_remaining": self._queue_remaining()}})

    async def _post_prompt(self, request: Request) -> Response:
        """server.py post_prompt(): Python's own `in` and indexing on whatever JSON arrived, so a list
        body is a 400 no_prompt, and a number or null body an unhandled 500."""
        body = await self._read_json(request)
        number = self._next_number(body)
        if not _has(body, "prompt"):
            return _json({"error": {"type": "no_prompt", "message": "No prompt provided",
                                    "details": "No prompt provided", "extra_info": {}}, "node_errors": {}}, 400)
        graph = _item(body, "prompt")
        prompt_id = str(body["prompt_id"]) if "prompt_id" in body else str(uuid.uuid4())
        targets = body["partial_execution_targets"] if "partial_execution_targets" in body else None
        result = validate(graph, self._classes, targets)
        extra_data = _extra_data(body)
        if isinstance(result, Rejected):
            return _json(result.body, 400)
        assert isinstance(result, Accepted)
        _stamp(extra_data)
        item = _Item(number, prompt_id, graph, extra_data, list(result.outputs))
        heapq.heappush(self._heap, (number, prompt_id, next(self._seq), item))
        self.accepted += 1
        self._broadcast_status()
        self._wake.set()
        return _json({"prompt_id": prompt_id, "number": number, "node_errors": result.node_errors})

    def _next_number(self, body: Any) -> int | float:
        """An explicit "number" is the priority; otherwise the counter, which every such POST advances."""
        if _has(body, "number"):
            try:
                return float(_item(body, "number"))
            except (TypeError, ValueError) as exc:
                raise _BadBody() from exc
        number = self._number
        if _has(body, "front") and _item(body, "front"):
            number = -number
        self._number += 1
        return number

    async def _get_queue(self, request: Request) -> Response:
        running, queued = self._queue_lists()
        return _json({"queue_running": running, "queue_pending": queued})

    async def _post_queue(self, request: Request) -> Response:
        body = await self._read_json(request)
        if isinstance(body, dict):
            if body.get("clear"):
                self._heap.clear()
            for prompt_id in body.get("delete") or []:
                self._heap = [e for e in self._heap if e[1] != prompt_id]
                heapq.heapify(self._heap)
        self._broadcast_status()
        return Response(status_code=200)

    async def _get_history(self, request: Request) -> Response:
        max_items = request.query_params.get("max_items")
        limit = int(max_items) if max_items is not None else None
        offset = int(request.query_params.get("offset", -1))
        if offset < 0 and limit is not None:
            offset = len(self._history) - limit
        out: JSON = {}
        for i, (key, entry) in enumerate(self._history.items()):
            if i >= offset:
                out[key] = entry
                if limit is not None and len(out) >= limit:
                    break
        return _json(out)

    async def _get_history_item(self, request: Request) -> Response:
        prompt_id = request.path_params["prompt_id"]
        entry = self._history.get(prompt_id)
        return _json({prompt_id: entry} if entry is not None else {})

    def _queue_lists(self) -> tuple[list[list[Any]], list[list[Any]]]:
        return [i.wire() for i in self._running.values()], [entry[3].wire() for entry in self._heap]

    async def _get_jobs(self, request: Request) -> Response:
        params = {key: request.query_params.getlist(key) for key in request.query_params}
        try:
            query = parse_query(params)
        except BadQuery as exc:
            return _json({"error": str(exc)}, 400)
        running, queued = self._queue_lists()
        jobs, total = list_jobs(query, running, queued, self._history)
        return _json({"jobs": jobs, "pagination": {"offset": query.offset, "limit": query.limit, "total": total,
                                                   "has_more": query.offset + len(jobs) < total}})

    async def _get_job(self, request: Request) -> Response:
        running, queued = self._queue_lists()
        job = find_job(request.path_params["job_id"], running, queued, self._history)
        return _json(job, 200) if job is not None else _json({"error": "Job not found"}, 404)

    async def _post_history(self, request: Request) -> Response:
        body = await self._read_json(request)
        if isinstance(body, dict):
            if body.get("clear"):
                self._history.clear()
            for prompt_id in body.get("delete") or []:
                self._history.pop(prompt_id, None)
        return Response(status_code=200)

    async def _interrupt_route(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = {}
        prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
        if prompt_id is None or prompt_id in self._running:
            self._interrupt = True
        return Response(status_code=200)

    async def _free(self, request: Request) -> Response:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise _BadBody()
        self.frees += 1
        for key in ("unload_models", "free_memory"):
            if key in body:
                self._free_flags[key] = bool(body[key])
        self._wake.set()
        return Response(status_code=200)

    async def _system_stats(self, request: Request) -> Response:
        page = os.sysconf("SC_PAGE_SIZE")
        held = self.gpu.used_by(self.pid) if self.pid is not None else 0
        reserved = max(0, held - self.config.context_floor_bytes)
        return _json({
            # sys.platform: the real 0.8.0 answered "linux" (0.3.64's source read os.name, "posix").
            "system": {"os": "linux", "ram_total": os.sysconf("SC_PHYS_PAGES") * page,
                       "ram_free": os.sysconf("SC_AVPHYS_PAGES") * page, "comfyui_version": self.config.version,
                       "required_frontend_version": FRONTEND_VERSION, "installed_templates_version": TEMPLATES_VERSION,
                       "required_templates_version": TEMPLATES_VERSION, "python_version": sys.version,
                       "pytorch_version": TORCH_VERSION, "embedded_python": False, "argv": list(self.config.argv)},
            "devices": [{"name": self.device_name, "type": "cuda", "index": 0,
                         "vram_total": self.gpu.total_bytes, "vram_free": self.gpu.free_bytes() + self._torch_cache,
                         "torch_vram_total": reserved, "torch_vram_free": min(self._torch_cache, reserved)}]})

    async def _object_info(self, request: Request) -> Response:
        return _json({name: cls.info() for name, cls in self._classes.items()})

    async def _object_info_one(self, request: Request) -> Response:
        cls = self._classes.get(request.path_params["node_class"])
        return _json({cls.name: cls.info()} if cls else {})

    async def _features_route(self, request: Request) -> Response:
        return _json(self._features())

    async def _models(self, request: Request) -> Response:
        return _json(MODEL_FOLDERS)

    async def _models_folder(self, request: Request) -> Response:
        folder = request.path_params["folder"]
        if folder == "checkpoints":
            return _json(sorted(self.config.checkpoints))
        if folder in MODEL_FOLDERS:
            return _json([])
        return Response(status_code=404)

    async def _list_empty(self, request: Request) -> Response:
        return _json([])

    def _folder(self, kind: str) -> Path | None:
        return self.base_dir / kind if kind in ("output", "input", "temp") else None

    async def _view(self, request: Request) -> Response:
        filename = request.query_params.get("filename")
        if not filename:
            return Response(status_code=404)
        kind = request.query_params.get("type", "output")
        for tag in ("output", "input", "temp"):  # "name.png [output]" annotation
            if filename.endswith(f" [{tag}]"):
                filename, kind = filename[: -len(tag) - 3], tag
        filename = unquote(filename)
        if filename.startswith("/") or ".." in filename:
            return Response(status_code=400)
        base = self._folder(kind)
        if base is None:
            return Response(status_code=400)
        folder = (base / request.query_params.get("subfolder", "")).resolve()
        if not folder.is_relative_to(base.resolve()):
            return Response(status_code=403)
        path = folder / filename
        if not path.is_file():
            return Response(status_code=404)
        response = FileResponse(path)
        response.headers["content-disposition"] = f'filename="{path.name}"'
        return response

    async def _upload_image(self, request: Request) -> Response:
        parts = parse_multipart(request.headers.get("content-type", ""), await request.body())
        image = parts.get("image")
        if image is None or not image.filename:
            return Response(status_code=400)
        kind = parts["type"].data.decode() if "type" in parts else "input"
        base = self._folder(kind or "input")
        if base is None:
            return Response(status_code=400)
        subfolder = parts["subfolder"].data.decode() if "subfolder" in parts else ""
        overwrite = parts["overwrite"].data.decode().lower() in ("true", "1") if "overwrite" in parts else False
        folder = (base / subfolder).resolve()
        filename = os.path.basename(image.filename)
        path = (folder / filename).resolve()
        if not folder.is_relative_to(base.resolve()) or path.parent != folder:
            return Response(status_code=400)
        duplicate = False
        if not overwrite:
            stem, ext = os.path.splitext(filename)
            i = 1
            while path.exists():
                if path.read_bytes() == image.data:  # ComfyUI compares hashes; equal bytes is the same test
                    duplicate = True
                    break
                filename = f"{stem} ({i}){ext}"
                path = folder / filename
                i += 1
        if not duplicate:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(image.data)
        return _json({"name": filename, "subfolder": subfolder, "type": kind})

    @property
    def user_data(self) -> UserData:
        """The user directory (`<base>/user`, user "default"): saved workflows, comfy.settings.json."""
        return UserData(self.base_dir / "user")

    def _one_segment(self, route: str, handler: Callable[[UserData, Request, str], Any]) -> Any:
        """A handler of an aiohttp `<route>/{name}` route: one raw segment, else nothing takes the path."""
        async def endpoint(request: Request) -> Response:
            value = raw_segment(request, route)
            if value is None:
                return _unrouted(request.method, set())
            response: Response = await handler(self.user_data, request, value)
            return response
        return endpoint

    async def _userdata_list(self, request: Request) -> Response:
        return await self.user_data.list(request)

    async def _get_settings(self, request: Request) -> Response:
        return await self.user_data.get_settings(request)

    async def _post_settings(self, request: Request) -> Response:
        return await self.user_data.post_settings(request)

    def _build_app(self) -> AiohttpHeaders:
        one = self._one_segment
        plain: list[tuple[str, Any, list[str]]] = [
            ("/", self._index, ["GET"]),
            ("/prompt", self._get_prompt, ["GET"]), ("/prompt", self._post_prompt, ["POST"]),
            ("/queue", self._get_queue, ["GET"]), ("/queue", self._post_queue, ["POST"]),
            ("/history", self._get_history, ["GET"]), ("/history", self._post_history, ["POST"]),
            ("/history/{prompt_id}", self._get_history_item, ["GET"]),
            # Registered with its /api in the path, so the prefixing also makes /api/api/jobs (as in server.py).
            ("/api/jobs", self._get_jobs, ["GET"]), ("/api/jobs/{job_id}", self._get_job, ["GET"]),
            ("/interrupt", self._interrupt_route, ["POST"]), ("/free", self._free, ["POST"]),
            ("/system_stats", self._system_stats, ["GET"]), ("/features", self._features_route, ["GET"]),
            ("/object_info", self._object_info, ["GET"]), ("/object_info/{node_class}", self._object_info_one, ["GET"]),
            ("/view", self._view, ["GET"]), ("/upload/image", self._upload_image, ["POST"]),
            ("/models", self._models, ["GET"]), ("/models/{folder}", self._models_folder, ["GET"]),
            ("/embeddings", self._list_empty, ["GET"]), ("/extensions", self._list_empty, ["GET"]),
            # app/user_manager.py and app/app_settings.py (single user)
            ("/userdata", self._userdata_list, ["GET"]),
            ("/userdata/{file:path}", one("/userdata", UserData.get), ["GET"]),
            ("/userdata/{file:path}", one("/userdata", UserData.post), ["POST"]),
            ("/userdata/{file:path}", one("/userdata", UserData.delete), ["DELETE"]),
            ("/settings", self._get_settings, ["GET"]), ("/settings", self._post_settings, ["POST"]),
            ("/settings/{id:path}", one("/settings", UserData.get_setting), ["GET"]),
            ("/settings/{id:path}", one("/settings", UserData.post_setting), ["POST"]),
        ]
        # Group methods per path so a wrong method gets 405, as aiohttp does.
        by_path: dict[str, dict[str, Any]] = {}
        for path, handler, methods in plain:
            for method in methods:
                by_path.setdefault(path, {})[method] = handler
        routes: list[BaseRoute] = []
        for prefix in ("", "/api"):
            for path, handlers in by_path.items():
                routes.append(Route(prefix + path, _dispatch(handlers), methods=_ALL_METHODS))  # _dispatch: 404/405
            routes.append(WebSocketRoute(prefix + "/ws", self._ws))

        async def bad_body(request: Request, exc: Exception) -> Response:
            return PlainTextResponse(AIOHTTP_500, status_code=500)

        app = Starlette(routes=routes, exception_handlers={_BadBody: bad_body, Unhandled: bad_body, BadJson: bad_body})
        app.router.default = _unrouted_app
        app.router.redirect_slashes = False  # aiohttp does not redirect /prompt/ to /prompt: a missing file
        return AiohttpHeaders(OriginAndSizeMiddleware(app, int(self.config.max_upload_size_mb * 1024 * 1024)))


def _dispatch(handlers: dict[str, Any]) -> Any:
    async def endpoint(request: Request) -> Response:
        handler = handlers.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            return _unrouted(request.method, set(handlers))
        response: Response = await handler(request)
        return response
    return endpoint


def _unrouted(method: str, allowed: set[str]) -> Response:
    """aiohttp with ComfyUI's static route on the web root, which takes every path for GET and HEAD:
    a path no route takes is a missing file (404, empty body), even a POST-only route asked with GET;
    other methods get 405 with the route's methods plus the static route's in Allow."""
    if method in ("GET", "HEAD"):
        return _MissingFile()
    return PlainTextResponse("405: Method Not Allowed", status_code=405,
                             headers={"Allow": ",".join(sorted(allowed | {"GET", "HEAD"}))})


class _MissingFile(Response):
    """The static route's answer for a file that is not there (aiohttp >= 3.10: a FileResponse whose
    stat fails sets 404 and sends its empty body): no Content-Length, so HTTP/1.1 streams it chunked,
    typed application/octet-stream by AiohttpHeaders."""

    def __init__(self) -> None:
        super().__init__(status_code=404)
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def _unrouted_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":
        await WebSocketClose()(scope, receive, send)  # before accept: the server answers 403
        return
    await _unrouted(scope["method"], set())(scope, receive, send)


def _has(container: Any, key: str) -> bool:
    """`key in json_data` as server.py writes it: a list or a string answers, anything else raises."""
    try:
        return key in container
    except TypeError as exc:
        raise _BadBody() from exc


def _item(container: Any, key: str) -> Any:
    try:
        return container[key]
    except (TypeError, KeyError, IndexError) as exc:
        raise _BadBody() from exc


def _extra_data(body: JSON) -> Any:
    """The client's extra_data object itself (not a copy), with client_id added as server.py does."""
    extra_data = body["extra_data"] if "extra_data" in body else {}
    if "client_id" in body:
        try:
            extra_data["client_id"] = body["client_id"]
        except TypeError as exc:
            raise _BadBody() from exc
    return extra_data


def _stamp(extra_data: Any) -> None:
    """What an accepted prompt's extra_data becomes: execution.SENSITIVE_EXTRA_DATA_KEYS removed (they
    never reach the queue or history), then create_time in ms (added with the jobs API, 0.8.0)."""
    try:
        for key in SENSITIVE_EXTRA_DATA_KEYS:
            if key in extra_data:
                extra_data.pop(key)
        extra_data["create_time"] = _ms()
    except (TypeError, AttributeError) as exc:
        raise _BadBody() from exc


def _meta(nid: str) -> JSON:
    return {"node_id": nid, "display_node": nid, "parent_node": None, "real_node_id": nid}


_FRESH = itertools.count()


def _signatures(graph: JSON) -> dict[str, str]:
    """Classic cache key: class and inputs, with links replaced by the upstream node's signature."""
    memo: dict[str, str] = {}

    def sig(nid: str, trail: tuple[str, ...]) -> str:
        if nid in memo:
            return memo[nid]
        if nid in trail:
            return "cycle"
        node = graph[nid]
        parts: list[Any] = [node["class_type"]]
        if node["class_type"] == "SaveImageWebsocket":
            parts.append(next(_FRESH))  # its IS_CHANGED returns time.time(): never cached
        for name, value in sorted((node.get("inputs") or {}).items()):
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] in graph:
                parts.append([name, sig(value[0], (*trail, nid)), value[1]])
            else:
                parts.append([name, value])
        memo[nid] = json.dumps(parts, sort_keys=True, default=str)
        return memo[nid]

    return {nid: sig(nid, ()) for nid in graph}


def _plain_image(image: tuple[str, bytes]) -> bytes:
    """Binary type 1: image format (1 JPEG, 2 PNG), then the encoded image."""
    kind, data = image
    return PREVIEW_IMAGE.to_bytes(4, "big") + (2 if kind == "PNG" else 1).to_bytes(4, "big") + data


def _image_with_metadata(image: tuple[str, bytes], nid: str, prompt_id: str) -> bytes:
    """Binary type 4: JSON length, the JSON (json.dumps, image_type added last), then the image."""
    kind, data = image
    meta = json.dumps({"node_id": nid, "prompt_id": prompt_id, "display_node_id": nid, "parent_node_id": None,
                       "real_node_id": nid, "image_type": "image/png" if kind == "PNG" else "image/jpeg"}).encode()
    return PREVIEW_IMAGE_WITH_METADATA.to_bytes(4, "big") + len(meta).to_bytes(4, "big") + meta + data


def _nearest_upstream(graph: JSON, nid: str, class_types: tuple[str, ...]) -> JSON | None:
    """The first node of one of these classes found walking up from a node (itself included), or None."""
    seen: set[str] = set()
    stack = [nid]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        node: JSON = graph[cur]
        if node["class_type"] in class_types:
            return node
        stack.extend(dependencies(graph, cur))
    return None


def _batch_size(graph: JSON, nid: str) -> int:
    """How many images reach a node: the batch_size of the EmptyImage or EmptyLatentImage upstream."""
    node = _nearest_upstream(graph, nid, ("EmptyImage", "EmptyLatentImage"))
    return 1 if node is None else int((node.get("inputs") or {}).get("batch_size", 1))


def _upstream_checkpoint(graph: JSON, nid: str) -> str | None:
    node = _nearest_upstream(graph, nid, ("CheckpointLoaderSimple",))
    name = None if node is None else (node.get("inputs") or {}).get("ckpt_name")
    return name if isinstance(name, str) else None


def _format_inputs(inputs: JSON) -> JSON:
    """execution.py format_value(): primitives as they are, linked objects as their repr, one per list item."""
    out: JSON = {}
    for name, value in inputs.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
            out[name] = [f"<linked output {value[1]} of node {value[0]}>"]
        elif value is None or isinstance(value, (int, float, bool, str)):
            out[name] = [value]
        else:
            out[name] = [str(value)]
    return out


def _oom_traceback(node_type: str) -> list[str]:
    func = "sample" if node_type == "KSampler" else "load_checkpoint"
    return [
        '  File "/opt/ComfyUI/execution.py", line 496, in execute\n    output_data, output_ui, has_subgraph, '
        'has_pending_tasks = await get_output_data(prompt_id, unique_id, obj, input_data_all, execution_block_cb='
        'execution_block_cb, pre_execute_cb=pre_execute_cb, hidden_inputs=hidden_inputs)\n',
        '  File "/opt/ComfyUI/execution.py", line 315, in get_output_data\n    return_values = await _async_map_node_'
        'over_list(prompt_id, unique_id, obj, input_data_all, obj.FUNCTION, allow_interrupt=True, execution_block_cb='
        'execution_block_cb, pre_execute_cb=pre_execute_cb, hidden_inputs=hidden_inputs)\n',
        f'  File "/opt/ComfyUI/nodes.py", line 1525, in {func}\n    return common_ksampler(model, seed, steps, cfg, '
        'sampler_name, scheduler, positive, negative, latent_image, denoise=denoise)\n',
        '  File "/opt/ComfyUI/comfy/model_management.py", line 1108, in cast_to\n    r = torch.empty_like(weight, '
        'dtype=dtype, device=device)\n',
    ]
