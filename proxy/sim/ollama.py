"""A simulated Ollama server (classic era, v0.12.x wire format) on a real socket.

Speaks the native API (/api/*) and the OpenAI compatibility layer (/v1/*) as described in
shared/reference/engine-wire-facts.md Part A, with runners as processes in a SimulatedGpu so a
proxy sees the same memory story as on a real card: nothing written before a load completes,
unload replies before the memory is back, eviction by shortest keep_alive, spill or OOM when short.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.clock import Clock, SystemClock
from proxy.relay.servers import RunningServer, start_server
from proxy.sim.gpu import GIB, SimulatedCard
from proxy.sim.model_files import SimModelFiles, load_seconds
from proxy.sim.ollama_decode import CHAT, COPY, DELETE, EMBED, EMBEDDING, GENERATE, PULL, SHOW, GoJSONError, Struct, decode
from proxy.sim.ollama_sched import CONTEXT_LENGTH, ApiError, Lease, LoadSpec, MemoryShort, Runner, Scheduler
from proxy.sim.ollama_wire import (
    CORS_ALLOW_HEADERS,
    CORS_ALLOW_METHODS,
    KeepAliveError,
    dumps,
    embedding,
    host_allowed,
    model_digest,
    normalise_name,
    ns,
    origin_allowed,
    parse_keep_alive,
    parse_keep_alive_env,
    qualified_name,
    rfc3339_nano,
    trailing_slash_redirect,
)

JSON_TYPE = "application/json; charset=utf-8"
NDJSON_TYPE = "application/x-ndjson"
SSE_TYPE = "text/event-stream"
TEXT_TYPE = "text/plain; charset=utf-8"
EMBED_DIMS = 384
HARMONY_FAMILIES = ("gptoss", "gpt-oss")  # shouldUseHarmony(): the only models taking think "high"/"medium"/"low"
_WORDS = ("The", " sky", " is", " blue", " because", " of", " Rayleigh", " scattering", " of", " sunlight",
          " by", " the", " air", ".", " Shorter", " wavelengths", " scatter", " more", ",", " so")


@dataclass(frozen=True, slots=True)
class SimModel:
    name: str  # "llama3.2:latest" form
    size_bytes: int
    family: str = "llama"
    parameter_size: str = "3.2B"
    quantization_level: str = "Q4_K_M"
    capabilities: tuple[str, ...] = ("completion",)  # ("embedding",) for embedding-only models
    digest: str = ""  # its manifest digest; "" = derived from the name (a copy keeps its source's)

    @property
    def manifest(self) -> str:
        return self.digest or model_digest(self.name)


_MB = 1000**2
# What the simulated registry has besides the configured models (the real library's sizes).
DEFAULT_REGISTRY: tuple[SimModel, ...] = (
    SimModel("tinyllama:latest", 637 * _MB, parameter_size="1B", quantization_level="Q4_0"),
    SimModel("tinyllama:1.1b", 637 * _MB, parameter_size="1B", quantization_level="Q4_0"),
    SimModel("phi3:latest", 2200 * _MB, family="phi3", parameter_size="3.8B", quantization_level="Q4_0"),
    SimModel("phi3:mini", 2200 * _MB, family="phi3", parameter_size="3.8B", quantization_level="Q4_0"),
    SimModel("llama3.2:latest", 2000 * _MB),
    SimModel("llama3.2:3b", 2000 * _MB),
    SimModel("llama3.2:1b", 1300 * _MB, parameter_size="1.2B", quantization_level="Q8_0"),
    SimModel("qwen2.5:0.5b", 398 * _MB, family="qwen2", parameter_size="494.03M"),
    SimModel("nomic-embed-text:latest", 274 * _MB, family="nomic-bert", parameter_size="137M",
             quantization_level="F16", capabilities=("embedding",)),
)


class _ScenarioModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    size_gb: float = Field(gt=0)
    family: str = "llama"
    parameter_size: str = "3.2B"
    quantization_level: str = "Q4_K_M"
    capabilities: list[str] = ["completion"]


class _Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    models: list[_ScenarioModel] = []
    load_gbps: float = Field(2.0, gt=0)
    disk_gbps: float | None = Field(None, gt=0)
    token_rate: float = Field(200.0, gt=0)
    unload_delay_s: float = Field(0.5, ge=0)
    keep_alive_default: str = "5m"
    memory_short: Literal["spill", "oom"] = "spill"
    max_loaded_models: int = Field(0, ge=0)
    num_parallel: int = Field(1, ge=1)
    max_queue: int = Field(512, ge=1)
    version: str = "0.12.3"
    loopback_host_check: bool = True
    origins: list[str] = []
    response_tokens: int = Field(12, ge=1)
    registry: list[_ScenarioModel] | None = None
    kv_bytes_per_token: int = Field(192 * 1024, ge=0)


@dataclass(frozen=True, slots=True)
class OllamaSimConfig:
    models: tuple[SimModel, ...]
    load_gbps: float = 2.0  # GB/s of 1e9 bytes (from the page cache, when disk_gbps is set)
    disk_gbps: float | None = None  # from disk: a load's time then follows its file's residency (model_files.py)
    token_rate: float = 200.0  # tokens/s
    unload_delay_s: float = 0.5  # from the unload reply to the memory really back in the GPU
    keep_alive_default: str = "5m"  # OLLAMA_KEEP_ALIVE
    memory_short: MemoryShort = "spill"
    max_loaded_models: int = 0  # 0 = 3 (3 x one GPU)
    num_parallel: int = 1
    max_queue: int = 512
    version: str = "0.12.3"
    loopback_host_check: bool = True
    origins: tuple[str, ...] = ()  # OLLAMA_ORIGINS
    response_tokens: int = 12
    registry: tuple[SimModel, ...] | None = None  # what /api/pull finds; None: DEFAULT_REGISTRY + models
    # the KV cache a token of context takes (f16, one slot): a load with num_ctx above the default
    # takes this much more per token (gemma3:27b: 17.2 GiB at 4096, 22.5 GiB at 32768)
    kv_bytes_per_token: int = 192 * 1024

    @classmethod
    def from_scenario(cls, section: dict[str, Any]) -> OllamaSimConfig:
        """The "ollama" object of a scenario file; sizes are GiB floats ("size_gb")."""
        try:
            sc = _Scenario.model_validate(section)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"invalid ollama scenario section: {problems}") from None
        try:
            parse_keep_alive_env(sc.keep_alive_default)
        except KeepAliveError as exc:
            raise ValueError(f"invalid ollama scenario section: keep_alive_default: {exc}") from None
        models = tuple(_sim_model(m) for m in sc.models)
        registry = tuple(_sim_model(m) for m in sc.registry) if sc.registry is not None else None
        return cls(models=models, load_gbps=sc.load_gbps, disk_gbps=sc.disk_gbps, token_rate=sc.token_rate,
                   unload_delay_s=sc.unload_delay_s, keep_alive_default=sc.keep_alive_default,
                   memory_short=sc.memory_short, max_loaded_models=sc.max_loaded_models,
                   num_parallel=sc.num_parallel, max_queue=sc.max_queue, version=sc.version,
                   loopback_host_check=sc.loopback_host_check, origins=tuple(sc.origins),
                   response_tokens=sc.response_tokens, registry=registry, kv_bytes_per_token=sc.kv_bytes_per_token)


def _sim_model(m: _ScenarioModel) -> SimModel:
    return SimModel(name=normalise_name(m.name), size_bytes=int(m.size_gb * GIB), family=m.family,
                    parameter_size=m.parameter_size, quantization_level=m.quantization_level,
                    capabilities=tuple(m.capabilities))


@dataclass(slots=True)
class _Catalog:
    """Models on disk: SimModel plus when it was 'pulled'."""

    models: dict[str, SimModel] = field(default_factory=dict)
    modified: dict[str, float] = field(default_factory=dict)
    blobs: dict[str, int] = field(default_factory=dict)  # "sha256:<hex>" -> size


Handler = Callable[[Request, Send], Awaitable[None]]


class OllamaSim:
    """The simulator. Observable counters are plain attributes for the proxy's tests."""

    def __init__(self, gpu: SimulatedCard, config: OllamaSimConfig, *, clock: Clock | None = None) -> None:
        self.gpu = gpu
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.cancellations = 0
        self.unload_requests = 0
        self.requests: dict[str, int] = {}
        self.server: RunningServer | None = None
        self._catalog = _Catalog()
        now = self.clock.wall()
        for m in config.models:
            m = replace(m, name=normalise_name(m.name))
            self._catalog.models[m.name] = m
            self._catalog.modified[m.name] = now - 86400.0
        self._changed = asyncio.Event()
        self._fail_stream: tuple[str, int] | None = None
        self.files: SimModelFiles | None = None  # real stand-in files: load times follow their residency
        self._sched = Scheduler(
            gpu, self.clock, load_gbps=config.load_gbps, unload_delay_s=config.unload_delay_s,
            default_keep_alive_s=parse_keep_alive_env(config.keep_alive_default),
            memory_short=config.memory_short,
            max_loaded=config.max_loaded_models or 3, num_parallel=config.num_parallel,
            max_queue=config.max_queue, notify=self._notify, load_time=self._load_seconds)
        self._app = _Asgi(self._asgi)
        self._routes: dict[str, dict[str, Handler]] = {
            "/": {"GET": self._root, "HEAD": self._root},
            "/api/version": {"GET": self._version, "HEAD": self._version},
            "/api/tags": {"GET": self._tags, "HEAD": self._tags},
            "/api/ps": {"GET": self._ps},
            "/api/show": {"POST": self._show},
            "/api/generate": {"POST": self._generate},
            "/api/chat": {"POST": self._chat},
            "/api/embed": {"POST": self._embed},
            "/api/embeddings": {"POST": self._embeddings},
            "/api/pull": {"POST": self._pull},
            "/api/delete": {"DELETE": self._delete},
            "/api/copy": {"POST": self._copy},
            "/api/blobs/:digest": {"HEAD": self._blob_head, "POST": self._blob_post},
            "/v1/chat/completions": {"POST": self._v1_chat},
            "/v1/completions": {"POST": self._v1_completions},
            "/v1/embeddings": {"POST": self._v1_embeddings},
            "/v1/models": {"GET": self._v1_models},
            "/v1/models/:model": {"GET": self._v1_model},
        }

    def _lease(self, m: SimModel, data: dict[str, Any], keep_alive: float | None) -> AbstractAsyncContextManager[Lease]:
        """The model's runner for this request: its content and runner options (a request with other
        ones reloads it), its size the weights plus the KV cache of its context beyond the default."""
        spec = LoadSpec.of(m.manifest, data.get("options"))
        size = m.size_bytes + self.config.kv_bytes_per_token * max(0, spec.num_ctx - CONTEXT_LENGTH)
        return self._sched.lease(m.name, size, keep_alive, spec)

    def _load_seconds(self, name: str, size: int) -> float:
        """From RAM at load_gbps, from disk at disk_gbps, by how much of the model's file is cached."""
        files, disk = self.files, self.config.disk_gbps
        if files is None or disk is None:
            return load_seconds(size, 1.0, self.config.load_gbps, None)
        blob = files.ollama_blob(name)
        resident = files.resident(blob)
        files.engine_read(blob)
        return load_seconds(size, resident, self.config.load_gbps, disk)

    # -- public API ---------------------------------------------------------------------------------
    @property
    def app(self) -> ASGIApp:
        return self._app

    @property
    def loads(self) -> int:
        return self._sched.loads

    @property
    def runners(self) -> Mapping[str, Runner]:
        """Model name -> its runner, loaded or loading (an unloaded one leaves at once, before its
        memory is back: `loaded()` counts that)."""
        return MappingProxyType(self._sched.runners)

    @property
    def load_clock(self) -> Clock:
        """The clock its loads step on (and its keep-alive timers wait on): a test swaps it to hold a
        load half way, however loaded the machine."""
        return self._sched.clock

    @load_clock.setter
    def load_clock(self, clock: Clock) -> None:
        self._sched.clock = clock

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
        self.server = await start_server(self._app, host, port, name="ollama-sim")
        return self.server

    async def stop(self) -> None:
        await self._sched.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None

    def loaded(self) -> dict[str, int]:
        """Model name -> bytes its runner process holds in the GPU now (unloaded runners count until
        their memory is really back)."""
        return self._sched.loaded()

    def set_memory_short(self, mode: MemoryShort) -> None:
        self._sched.memory_short = mode

    def fail_next_load_with(self, message: str, times: int = 1) -> None:
        """The next load's runner dies part-way: 500 {"error": message}, its memory is gone (the next
        `times` loads)."""
        self._sched.fail_next_load = message
        self._sched.fail_loads = times

    def fail_next_stream_with(self, message: str, after_chunks: int = 1) -> None:
        """The next streamed generation writes `after_chunks` chunks, then an {"error"} line, no done line."""
        self._fail_stream = (message, after_chunks)

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Wait for a state change making predicate true (tests: no sleeps)."""
        async def _wait() -> None:
            while not predicate():
                event = self._changed
                await event.wait()
        await asyncio.wait_for(_wait(), timeout_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- ASGI plumbing --------------------------------------------------------------------------------
    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        if await self._redirected(request, send):
            return
        headers = request.headers
        host = headers.get("host", "")
        origin = headers.get("origin")
        cors_headers: list[tuple[bytes, bytes]] = []
        if origin and origin not in (f"http://{host}", f"https://{host}"):
            if not origin_allowed(origin, self.config.origins):
                await _send_plain(send, 403, b"", None)
                return
            cors_headers = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
            if request.method == "OPTIONS":
                await _send_raw(send, 204, b"", None, [
                    *cors_headers,
                    (b"access-control-allow-methods", CORS_ALLOW_METHODS.encode()),
                    (b"access-control-allow-headers", CORS_ALLOW_HEADERS.encode()),
                    (b"access-control-max-age", b"43200")])
                return
        if self.config.loopback_host_check and not host_allowed(host):
            await _send_plain(send, 403, b"", None)
            return
        path = scope["path"]
        route, methods = self._match(path)
        if methods is None:
            await _send_plain(send, 404, b"404 page not found", TEXT_TYPE)
            return
        handler = methods.get(request.method)
        if handler is None:
            await _send_plain(send, 405, b"405 method not allowed", TEXT_TYPE)
            return
        self.requests[path] = self.requests.get(path, 0) + 1
        wrapped = _with_headers(send, cors_headers) if cors_headers else send
        v1 = route.startswith("/v1/")
        if route == "/api/blobs/:digest":
            await self._guard(handler, request, wrapped, v1)
            return
        await request.body()
        work = asyncio.ensure_future(self._guard(handler, request, wrapped, v1))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            watcher.cancel()
            work.result()
            return
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        if route in ("/api/generate", "/api/chat", "/v1/chat/completions", "/v1/completions"):
            self.cancellations += 1
            self._notify()

    async def _redirected(self, request: Request, send: Send) -> bool:
        """gin's trailing-slash redirect: decided by the router before any middleware (no CORS or Host
        check), when the path is not routed for this method but the path without its slash is."""
        path, method = request.url.path, request.method
        if path == "/" or not path.endswith("/") or method in (self._match(path)[1] or {}):
            return False
        if method not in (self._match(path[:-1])[1] or {}):
            return False
        redirect = trailing_slash_redirect(method, path, request.url.query,
                                           request.headers.get("x-forwarded-prefix", ""))
        headers = [(b"location", redirect.location.encode())]
        await _send_raw(send, redirect.status, redirect.body, redirect.content_type, headers)
        return True

    def _match(self, path: str) -> tuple[str, dict[str, Handler] | None]:
        if path in self._routes:
            return path, self._routes[path]
        for prefix, route in (("/api/blobs/", "/api/blobs/:digest"), ("/v1/models/", "/v1/models/:model")):
            rest = path[len(prefix):]
            if path.startswith(prefix) and rest and "/" not in rest:
                return route, self._routes[route]
        return path, None

    async def _guard(self, handler: Handler, request: Request, send: Send, v1: bool) -> None:
        try:
            await handler(request, send)
        except ApiError as exc:
            body: dict[str, Any]
            if v1:
                kind = {400: "invalid_request_error", 404: "not_found_error"}.get(exc.status, "api_error")
                body = {"error": {"message": exc.message, "type": kind, "param": None, "code": None}}
            else:
                body = {"error": exc.message}
            await _send_plain(send, exc.status, dumps(body), JSON_TYPE)

    # -- helpers --------------------------------------------------------------------------------------
    async def _json_body(self, request: Request, go_type: str = "api.Request") -> dict[str, Any]:
        """A body for the /v1 handlers: JSON that must be an object."""
        raw = await request.body()
        if not raw.strip():
            raise ApiError(400, "missing request body")
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ApiError(400, _syntax_error(exc)) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"json: cannot unmarshal {_json_kind(data)} into Go value of type {go_type}")
        return data

    async def _bind(self, request: Request, spec: Struct) -> dict[str, Any]:
        """gin's ShouldBindJSON into the handler's request struct: Go's decoding and its error texts."""
        raw = await request.body()
        if not raw.strip():
            raise ApiError(400, "missing request body")
        try:
            return decode(raw, spec)
        except json.JSONDecodeError as exc:
            raise ApiError(400, _syntax_error(exc)) from None
        except GoJSONError as exc:
            raise ApiError(400, str(exc)) from None

    def _lookup(self, name: object) -> SimModel | None:
        """Names compare case-insensitively, with ":latest" implied."""
        if not isinstance(name, str) or not name:
            return None
        wanted = normalise_name(name).lower()
        return next((m for key, m in self._catalog.models.items() if key.lower() == wanted), None)

    def _require(self, name: object) -> SimModel:
        model = self._lookup(name)
        if model is None:
            raise ApiError(404, f"model '{name if isinstance(name, str) else ''}' not found")
        return model

    @staticmethod
    def _check_capabilities(m: SimModel, name: object, wanted: list[str], verb: str) -> None:
        """Model.CheckCapabilities through scheduleRunner: no completion is '"m" does not support
        generate|chat'; anything else missing names the model in full, the capabilities joined by
        newlines (errors.Join): 'registry.ollama.ai/library/m:latest does not support tools'."""
        missing = [cap for cap in wanted if cap not in m.capabilities]
        if "completion" in missing:
            raise ApiError(400, f"{json.dumps(name)} does not support {verb}")
        if missing:
            raise ApiError(400, f"{qualified_name(m.name)} does not support " + "\n".join(missing))

    @staticmethod
    def _keep_alive(data: dict[str, Any]) -> float | None:
        try:
            return parse_keep_alive(data.get("keep_alive"))
        except KeepAliveError as exc:
            raise ApiError(400, str(exc)) from None

    def _now(self) -> str:
        return rfc3339_nano(self.clock.wall(), local=False)

    def _details(self, m: SimModel) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": m.family, "families": [m.family],
                "parameter_size": m.parameter_size, "quantization_level": m.quantization_level}

    def _tokens(self, data: dict[str, Any]) -> tuple[list[str], str]:
        n = self.config.response_tokens
        reason = "stop"
        options = data.get("options") if isinstance(data.get("options"), dict) else {}
        limit = options.get("num_predict") if options else None
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < n:
            n, reason = limit, "length"
        return [_WORDS[i % len(_WORDS)] for i in range(n)], reason

    async def _token_pause(self) -> None:
        await self.clock.sleep(1.0 / self.config.token_rate)

    def _take_stream_failure(self) -> tuple[str, int] | None:
        fail, self._fail_stream = self._fail_stream, None
        return fail

    # -- routes: basics -------------------------------------------------------------------------------
    async def _root(self, request: Request, send: Send) -> None:
        await _send_plain(send, 200, b"Ollama is running", TEXT_TYPE)

    async def _version(self, request: Request, send: Send) -> None:
        await _send_json(send, 200, {"version": self.config.version})

    def _tag_entry(self, m: SimModel) -> dict[str, Any]:
        return {"name": m.name, "model": m.name, "modified_at": rfc3339_nano(self._catalog.modified[m.name], local=True),
                "size": m.size_bytes, "digest": m.manifest, "details": self._details(m)}

    async def _tags(self, request: Request, send: Send) -> None:
        models = sorted(self._catalog.models.values(), key=lambda m: -self._catalog.modified[m.name])
        await _send_json(send, 200, {"models": [self._tag_entry(m) for m in models]})

    async def _ps(self, request: Request, send: Send) -> None:
        entries = []
        for r in sorted(self._sched.runners.values(), key=lambda r: -r.expires_at_wall):
            m = self._catalog.models.get(r.name) or SimModel(r.name, r.size)
            entries.append({"name": r.name, "model": r.name, "size": r.size, "digest": r.spec.digest or m.manifest,
                            "details": self._details(m), "expires_at": rfc3339_nano(r.expires_at_wall, local=True),
                            "size_vram": r.size_vram,
                            "context_length": r.spec.num_ctx})
        await _send_json(send, 200, {"models": entries})

    async def _show(self, request: Request, send: Send) -> None:
        data = await self._bind(request, SHOW)
        name = data.get("model") or data.get("name")
        m = self._require(name)
        params = int(float(m.parameter_size.rstrip("BbMm") or 0) * (1e9 if m.parameter_size[-1:] in "Bb" else 1e6))
        # ShowResponse fields are omitempty: no license and no tensors here, so neither key is sent.
        await _send_json(send, 200, {
            "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM {m.name}\n",
            "parameters": "stop                           \"<|eot_id|>\"",
            "template": "{{ .Prompt }}", "details": self._details(m),
            "model_info": {"general.architecture": m.family, "general.parameter_count": params,
                           f"{m.family}.context_length": 131072, f"{m.family}.embedding_length": 3072,
                           "tokenizer.ggml.tokens": [] if not data.get("verbose") else ["<s>", "</s>"]},
            "capabilities": list(m.capabilities),
            "modified_at": rfc3339_nano(self._catalog.modified[m.name], local=True)})

    # -- routes: generation ---------------------------------------------------------------------------
    async def _generate(self, request: Request, send: Send) -> None:
        """GenerateHandler (v0.12.3): the model must exist, then unload, raw, think and capability checks."""
        started = self.clock.now()
        data = await self._bind(request, GENERATE)
        keep_alive = self._keep_alive(data)
        name = data.get("model")
        m = self._require(name)
        prompt = data.get("prompt") or ""
        head = {"model": name, "created_at": ""}
        if not prompt and keep_alive == 0:
            self.unload_requests += 1
            self._sched.expire(m.name)
            self._notify()
            await _send_json(send, 200, {**head, "created_at": self._now(), "response": "", "done": True,
                                         "done_reason": "unload"})
            return
        if data.get("raw") and (data.get("template") or data.get("system") or data.get("context")):
            raise ApiError(400, "raw mode does not support template, system, or context")
        think = data.get("think")
        if isinstance(think, str) and m.family not in HARMONY_FAMILIES:
            raise ApiError(400, f"think value {json.dumps(think)} is not supported for this model")
        wanted = ["completion"] + (["insert"] if data.get("suffix") else []) + (["thinking"] if think else [])
        self._check_capabilities(m, name, wanted, "generate")
        async with self._lease(m, data, keep_alive) as lease:
            if not prompt:
                await _send_json(send, 200, {**head, "created_at": self._now(), "response": "", "done": True,
                                             "done_reason": "load"})
                return
            await self._run_native(send, data, lease, started, lambda text: {"response": text},
                                   context=not data.get("raw"), prompt_tokens=_count(prompt))

    async def _chat(self, request: Request, send: Send) -> None:
        """ChatHandler (v0.12.3): a model name, the model, unload, then capability checks."""
        started = self.clock.now()
        data = await self._bind(request, CHAT)
        keep_alive = self._keep_alive(data)
        name = data.get("model")
        if not name:
            raise ApiError(400, "model is required")
        m = self._require(name)
        messages = data.get("messages") or []
        head = {"model": name, "created_at": ""}
        empty = {"role": "assistant", "content": ""}
        # v0.12.3 tests int(keep_alive.Seconds()) == 0 here: any keep_alive under a second unloads.
        if not messages and keep_alive is not None and 0 <= keep_alive < 1:
            self.unload_requests += 1
            self._sched.expire(m.name)
            self._notify()
            await _send_json(send, 200, {**head, "created_at": self._now(), "message": empty, "done": True,
                                         "done_reason": "unload"})
            return
        wanted = ["completion"] + (["tools"] if data.get("tools") else []) + (["thinking"] if data.get("think") else [])
        self._check_capabilities(m, name, wanted, "chat")
        async with self._lease(m, data, keep_alive) as lease:
            if not messages:
                await _send_json(send, 200, {**head, "created_at": self._now(), "message": empty, "done": True,
                                             "done_reason": "load"})
                return
            text_in = " ".join(str(msg.get("content", "")) for msg in messages if isinstance(msg, dict))
            await self._run_native(send, data, lease, started,
                                   lambda text: {"message": {"role": "assistant", "content": text}},
                                   context=False, prompt_tokens=_count(text_in))

    async def _run_native(self, send: Send, data: dict[str, Any], lease: Lease, started: float,
                          body: Callable[[str], dict[str, Any]], *, context: bool, prompt_tokens: int) -> None:
        name = data.get("model")
        tokens, reason = self._tokens(data)
        stream = data.get("stream", True) is not False
        fail = self._take_stream_failure() if stream else None
        async with lease.runner.sem:  # NUM_PARALLEL slots
            await self.gpu.cuda_ready(lease.runner.pid)  # a suspended runner's CUDA calls block
            eval_started = self.clock.now()

            def final() -> dict[str, Any]:
                now = self.clock.now()
                out: dict[str, Any] = {"model": name, "created_at": self._now(),
                                       **body("" if stream else "".join(tokens)), "done": True, "done_reason": reason}
                if context:
                    out["context"] = list(range(1, prompt_tokens + len(tokens) + 1))
                out.update({"total_duration": ns(now - started), "load_duration": ns(lease.load_duration_s),
                            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": ns(0.001 * prompt_tokens)})
                if tokens:
                    out.update({"eval_count": len(tokens), "eval_duration": ns(now - eval_started)})
                return out

            if not stream:
                for _ in tokens:
                    await self._token_pause()
                await _send_json(send, 200, final())
                return

            async def lines() -> AsyncIterator[bytes]:
                for i, tok in enumerate(tokens):
                    if fail is not None and i >= fail[1]:
                        yield dumps({"error": fail[0]}) + b"\n"
                        return
                    await self._token_pause()
                    yield dumps({"model": name, "created_at": self._now(), **body(tok), "done": False}) + b"\n"
                yield dumps(final()) + b"\n"

            await _send_stream(send, NDJSON_TYPE, lines())

    # -- routes: embeddings ---------------------------------------------------------------------------
    async def _embed(self, request: Request, send: Send) -> None:
        started = self.clock.now()
        data = await self._bind(request, EMBED)
        keep_alive = self._keep_alive(data)
        name = data.get("model")
        m = self._require(name)
        raw = data.get("input")
        if raw is None or raw == "" or raw == []:
            inputs: list[str] = []
        elif isinstance(raw, str):
            inputs = [raw]
        elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
            inputs = list(raw)
        else:
            raise ApiError(400, "invalid input type")
        dims = data.get("dimensions") or EMBED_DIMS
        if not isinstance(dims, int) or dims < 1:
            raise ApiError(400, "dimensions must be a positive integer")
        dims = min(dims, EMBED_DIMS)
        async with self._lease(m, data, keep_alive) as lease:
            if not inputs:
                await _send_json(send, 200, {"model": name, "embeddings": []})
                return
            async with lease.runner.sem:
                await self.gpu.cuda_ready(lease.runner.pid)  # a suspended runner's CUDA calls block
                await self._token_pause()
                vectors = [embedding(m.name, text, dims) for text in inputs]
            await _send_json(send, 200, {"model": name, "embeddings": vectors,
                                         "total_duration": ns(self.clock.now() - started),
                                         "load_duration": ns(lease.load_duration_s),
                                         "prompt_eval_count": sum(_count(t) for t in inputs)})

    async def _embeddings(self, request: Request, send: Send) -> None:
        data = await self._bind(request, EMBEDDING)
        keep_alive = self._keep_alive(data)
        m = self._require(data.get("model"))
        prompt = data.get("prompt") or ""
        async with self._lease(m, data, keep_alive) as lease:
            if not prompt:
                await _send_json(send, 200, {"embedding": []})
                return
            async with lease.runner.sem:
                await self.gpu.cuda_ready(lease.runner.pid)  # a suspended runner's CUDA calls block
                await self._token_pause()
            await _send_json(send, 200, {"embedding": embedding(m.name, str(prompt), EMBED_DIMS)})

    # -- routes: model management ---------------------------------------------------------------------
    async def _pull(self, request: Request, send: Send) -> None:
        """PullHandler: 'pulling manifest', then the layers of a model the simulated registry has, or
        'pull model manifest: file does not exist' (an NDJSON error line after the 200, or a 500 with
        stream false). waitForStream answers stream false with a bare application/json."""
        data = await self._bind(request, PULL)
        raw_name = data.get("model") or data.get("name")
        if not isinstance(raw_name, str) or not raw_name:
            raise ApiError(400, "invalid model name")
        model = self._in_registry(normalise_name(raw_name))
        lines: list[dict[str, Any]] = [{"status": "pulling manifest"}]
        lines += _pull_progress(model) if model else [{"error": "pull model manifest: file does not exist"}]
        if data.get("stream") is False:
            if model:
                self._add_pulled(model)
            last = lines[-1]
            await _send_raw(send, 500 if "error" in last else 200, dumps(last), "application/json")
            return

        async def stream() -> AsyncIterator[bytes]:
            for line in lines:
                if model and line.get("status") == "success":
                    self._add_pulled(model)
                await asyncio.sleep(0)
                yield dumps(line) + b"\n"

        await _send_stream(send, NDJSON_TYPE, stream())

    def _in_registry(self, name: str) -> SimModel | None:
        """The simulated registry: config.registry, else the default one plus the configured models."""
        catalog = self.config.registry if self.config.registry is not None else DEFAULT_REGISTRY + self.config.models
        wanted = name.lower()
        found = next((m for m in catalog if normalise_name(m.name).lower() == wanted), None)
        return replace(found, name=normalise_name(found.name)) if found else None

    def _add_pulled(self, model: SimModel) -> None:
        self._catalog.models[model.name] = model
        self._catalog.modified[model.name] = self.clock.wall()
        for digest, size in _layers(model):
            self._catalog.blobs[f"sha256:{digest}"] = size

    async def _delete(self, request: Request, send: Send) -> None:
        data = await self._bind(request, DELETE)
        name = data.get("model") or data.get("name")
        m = self._require(name)
        self._sched.expire(m.name)
        del self._catalog.models[m.name]
        self._catalog.modified.pop(m.name, None)
        await _send_plain(send, 200, b"", None)

    async def _copy(self, request: Request, send: Send) -> None:
        data = await self._bind(request, COPY)
        source, dest = data.get("source"), data.get("destination")
        m = self._lookup(source)
        if m is None:
            raise ApiError(404, f"model {json.dumps(source if isinstance(source, str) else '')} not found")
        if not isinstance(dest, str) or not dest:
            raise ApiError(400, f"invalid destination name: {json.dumps(dest if isinstance(dest, str) else '')}")
        copy = replace(m, name=normalise_name(dest), digest=m.manifest)  # the same manifest under another name
        self._catalog.models[copy.name] = copy
        self._catalog.modified[copy.name] = self.clock.wall()
        await _send_plain(send, 200, b"", None)

    def _digest_param(self, request: Request) -> str:
        digest = request.url.path.rsplit("/", 1)[-1]
        hexpart = digest.removeprefix("sha256:").removeprefix("sha256-")
        if not digest.startswith(("sha256:", "sha256-")) or len(hexpart) != 64 or any(
                c not in "0123456789abcdef" for c in hexpart):
            raise ApiError(400, "invalid digest format")
        return f"sha256:{hexpart}"

    async def _blob_head(self, request: Request, send: Send) -> None:
        digest = self._digest_param(request)
        if digest not in self._catalog.blobs:
            raise ApiError(404, f"blob {json.dumps(digest)} not found")
        await _send_plain(send, 200, b"", None)

    async def _blob_post(self, request: Request, send: Send) -> None:
        digest = self._digest_param(request)
        if digest in self._catalog.blobs:
            await _send_plain(send, 200, b"", None)
            return
        hasher = hashlib.sha256()
        size = 0
        async for chunk in request.stream():  # multi-GB bodies: hash as they come, keep nothing
            hasher.update(chunk)
            size += len(chunk)
        got = f"sha256:{hasher.hexdigest()}"
        if got != digest:
            raise ApiError(400, f"digest mismatch, expected {json.dumps(digest)}, got {json.dumps(got)}")
        self._catalog.blobs[digest] = size
        await _send_plain(send, 201, b"", None)

    # -- routes: OpenAI compatibility ---------------------------------------------------------------------
    async def _v1_chat(self, request: Request, send: Send) -> None:
        await self._v1_generate(request, send, chat=True)

    async def _v1_completions(self, request: Request, send: Send) -> None:
        await self._v1_generate(request, send, chat=False)

    async def _v1_generate(self, request: Request, send: Send, *, chat: bool) -> None:
        data = await self._json_body(request, "openai.ChatCompletionRequest" if chat else "openai.CompletionRequest")
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "[] is too short - 'messages'")
            prompt_text = " ".join(str(x.get("content", "")) for x in messages if isinstance(x, dict))
        else:
            prompt_text = str(data.get("prompt") or "")
        name = data.get("model")
        if chat and not name:
            raise ApiError(400, "model is required")
        m = self._require(name)
        if "completion" not in m.capabilities:
            raise ApiError(400, f"{json.dumps(name)} does not support {'chat' if chat else 'generate'}")
        options: dict[str, Any] = {}
        if isinstance(data.get("max_tokens"), int):
            options["num_predict"] = data["max_tokens"]
        tokens, reason = self._tokens({"options": options})
        stream = bool(data.get("stream"))
        usage_wanted = bool((data.get("stream_options") or {}).get("include_usage"))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{random.randrange(999)}"
        created = int(self.clock.wall())
        kind = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": _count(prompt_text), "completion_tokens": len(tokens),
                 "total_tokens": _count(prompt_text) + len(tokens)}
        async with self._lease(m, {}, None) as lease:
            async with lease.runner.sem:
                await self.gpu.cuda_ready(lease.runner.pid)  # a suspended runner's CUDA calls block
                if not stream:
                    for _ in tokens:
                        await self._token_pause()
                    text = "".join(tokens)
                    choice: dict[str, Any] = (
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                        if chat else {"text": text, "index": 0, "finish_reason": reason})
                    await _send_json(send, 200, {"id": ident, "object": kind, "created": created, "model": name,
                                                 "system_fingerprint": "fp_ollama", "choices": [choice],
                                                 "usage": usage})
                    return

                def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
                    obj = {"id": ident, "object": f"{kind}.chunk" if chat else kind, "created": created,
                           "model": name, "system_fingerprint": "fp_ollama", "choices": choices, **(extra or {})}
                    return b"data: " + dumps(obj) + b"\n\n"

                async def events() -> AsyncIterator[bytes]:
                    for i, tok in enumerate(tokens):
                        await self._token_pause()
                        if chat:
                            delta = {"role": "assistant", "content": tok} if i == 0 else {"content": tok}
                            yield chunk([{"index": 0, "delta": delta, "finish_reason": None}])
                        else:
                            yield chunk([{"text": tok, "index": 0, "finish_reason": None}])
                    if chat:
                        yield chunk([{"index": 0, "delta": {}, "finish_reason": reason}])
                    else:
                        yield chunk([{"text": "", "index": 0, "finish_reason": reason}])
                    if usage_wanted:
                        yield chunk([], {"usage": usage})
                    yield b"data: [DONE]\n\n"

                await _send_stream(send, SSE_TYPE, events())

    async def _v1_embeddings(self, request: Request, send: Send) -> None:
        data = await self._json_body(request, "openai.EmbedRequest")
        raw = data.get("input")
        if isinstance(raw, str) and raw:
            inputs = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            inputs = list(raw)
        else:
            raise ApiError(400, "invalid input")
        name = data.get("model")
        m = self._require(name)
        dims = data.get("dimensions")
        if not isinstance(dims, int):
            dims = EMBED_DIMS
        async with self._lease(m, {}, None) as lease:
            async with lease.runner.sem:
                await self.gpu.cuda_ready(lease.runner.pid)  # a suspended runner's CUDA calls block
                await self._token_pause()
        count = sum(_count(t) for t in inputs)
        await _send_json(send, 200, {
            "object": "list",
            "data": [{"object": "embedding", "embedding": embedding(m.name, t, min(dims, EMBED_DIMS)), "index": i}
                     for i, t in enumerate(inputs)],
            "model": name, "usage": {"prompt_tokens": count, "total_tokens": count}})

    def _v1_entry(self, m: SimModel) -> dict[str, Any]:
        owner = m.name.split("/")[-2] if "/" in m.name else "library"
        return {"id": m.name, "object": "model", "created": int(self._catalog.modified[m.name]), "owned_by": owner}

    async def _v1_models(self, request: Request, send: Send) -> None:
        models = sorted(self._catalog.models.values(), key=lambda m: -self._catalog.modified[m.name])
        # Go serialises an empty (nil) slice as null
        await _send_json(send, 200, {"object": "list", "data": [self._v1_entry(m) for m in models] or None})

    async def _v1_model(self, request: Request, send: Send) -> None:
        name = request.url.path.rsplit("/", 1)[-1]
        m = self._require(name)
        await _send_json(send, 200, self._v1_entry(m))


class _Asgi:
    """An ASGI3 callable (uvicorn takes a bound method for ASGI2)."""

    def __init__(self, target: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._target(scope, receive, send)


def _layers(model: SimModel) -> list[tuple[str, int]]:
    """(digest hex, size) of a pulled model's blobs: the weights and a small config."""
    return [(hashlib.sha256(f"layer:{model.name}:{i}".encode()).hexdigest(), size)
            for i, size in enumerate((model.size_bytes - 12_000, 12_000))]


def _pull_progress(model: SimModel) -> list[dict[str, Any]]:
    """The NDJSON lines after 'pulling manifest': each layer at 0, half and all, then the end."""
    out: list[dict[str, Any]] = []
    for digest, size in _layers(model):
        for done in (0, size // 2, size):
            line: dict[str, Any] = {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": size}
            if done:
                line["completed"] = done
            out.append(line)
    return [*out, {"status": "verifying sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}]


def _syntax_error(exc: json.JSONDecodeError) -> str:
    return f"invalid character looking for beginning of value at offset {exc.pos}"


_KINDS_BY_TYPE: dict[type, str] = {list: "array", str: "string"}


def _json_kind(value: Any) -> str:
    """The JSON kind as Go's UnmarshalTypeError names it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return _KINDS_BY_TYPE.get(type(value), "object")


def _count(text: str) -> int:
    return max(1, len(text.split()))


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers", [])) + extra}
        await send(message)
    return wrapped


async def _send_raw(send: Send, status: int, body: bytes, content_type: str | None,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_plain(send: Send, status: int, body: bytes, content_type: str | None) -> None:
    await _send_raw(send, status, body, content_type)


async def _send_json(send: Send, status: int, obj: Any) -> None:
    await _send_raw(send, status, dumps(obj), JSON_TYPE)


async def _send_stream(send: Send, content_type: str, chunks: AsyncIterator[bytes]) -> None:
    """Headers go out with the first chunk (like gin's c.Stream); each chunk is flushed on its own."""
    started = False
    async for chunk in chunks:
        if not started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", content_type.encode())]})
            started = True
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    if not started:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode())]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


__all__ = ["MemoryShort", "OllamaSim", "OllamaSimConfig", "SimModel"]
