"""Ollama: which routes load a model, the Host rule of a loopback-bound server, model sizes from
/api/tags, OOM answers, /api/ps (self-report and CPU spill), and the OLLAMA_* settings.

Ollama bound to loopback answers 403 (empty body) to a Host it does not consider local, so the
upstream always gets the upstream's own Host (engine-wire-facts A.1). That hides the client's Host
from Ollama, so the listener applies Ollama's own Host rule first (`host_policy`). Its CORS check
passes `Origin == http://<Host>`, so the base same-origin rewrite keeps browser pages working.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx

from proxy.config.schema import ReleaseSpec, Tenant
from proxy.config.units import GIB
from proxy.engines import settings as es
from proxy.engines.base import EngineAdapter
from proxy.engines.common import Need, ReleaseFailed, json_or_none, upstream_of
from proxy.engines.model_files import FileHints, TenantFiles, ollama_tenant_files
from proxy.engines.ollama_catalog import OllamaCatalog, canonical, load_shape, variant
from proxy.engines.ports import CatalogModel, Placement, Relocation, RequestKind, Streamed, StreamFormat, TenantCatalog
from proxy.gpu.attribution import AttributedSnapshot
from proxy.hosts import HostPolicy, is_loopback_host, listener_policy

log = logging.getLogger("hyperswap.engines")

# Ollama's own classifier (llm/status.go IsOutOfMemory): case-insensitive substrings.
OLLAMA_OOM_MARKERS = ("out of memory", "out of device memory", "cudamalloc failed", "hipmalloc failed",
                      "failed to allocate", "allocation failed", "not enough memory", "insufficient memory",
                      "vk_error_out_of_device_memory", "unable to allocate cuda")

PARSED_KEPT_MAX = 64 * 1024  # a request body up to this is kept parsed until the next one (OllamaAdapter._request_json)

# POST routes that schedule a runner (load a model). /api/pull only downloads: no GPU.
GPU_ROUTES = frozenset({
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
})


_STREAMS: dict[str, StreamFormat] = {"/api/chat": "ndjson-chat", "/api/generate": "ndjson-generate",
                                      "/v1/chat/completions": "sse-chat", "/v1/completions": "sse-completion"}

# Ollama's unload path (engine-wire-facts A.3/A.4): keep_alive exactly 0 and nothing to run.
UNLOAD_ROUTES = {"/api/generate": "prompt", "/api/chat": "messages"}
# A Go duration string (time.ParseDuration): "0", "0s", "0m0s", "0.0h"...
_GO_DURATION = re.compile(r"^[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|\u00b5s|ms|s|m|h))+$")
_LOAD_DURATION = re.compile(rb'"load_duration"\s*:\s*(\d+)')


def keep_alive_is_zero(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == 0
    if isinstance(value, str):
        if value == "0":
            return True
        return bool(_GO_DURATION.match(value)) and not any(c in "123456789" for c in value)
    return False


def ollama_load_seconds(tail: bytes) -> float | None:
    """The last `load_duration` (int64 nanoseconds) in the end of an Ollama answer, in seconds."""
    found = _LOAD_DURATION.findall(tail)
    return int(found[-1]) / 1e9 if found else None


def ollama_error_is_oom(message: str) -> bool:
    low = message.lower()
    return any(marker in low for marker in OLLAMA_OOM_MARKERS) and "system memory" not in low


class OllamaAdapter(EngineAdapter):
    kind = "ollama"
    answers_oom = True
    sized_catalog = True
    placements_path = "/api/ps"
    probe_path = "/api/version"
    ready_path = "/api/version"  # answers 200 as soon as the server accepts requests
    starts_loaded = False  # models load per request
    probe_strict = True
    verify_role = "generates"
    start_hint = "start Ollama (`systemctl start ollama` or `ollama serve`)"
    runs_at_once_default = 1  # OLLAMA_NUM_PARALLEL's default since v0.10 (engine-wire-facts)
    head_model_fields = ("model",)  # Ollama's and the /v1 bodies name it so (the ollama client sends it first)

    def __init__(self, tenant: Tenant) -> None:
        super().__init__(tenant)
        self.sizes = OllamaCatalog()  # per adapter, so per tenant: refreshed when a name is missing
        self._parsed: tuple[bytes, object] = (b"", None)  # the last request body read, and what it parsed to

    def _request_json(self, body: bytes) -> object:
        """A GPU request's body as JSON (None: not JSON), parsed once for the questions asked of the
        same request (its stream format, its need, its answer): the listener hands each of them the
        same bytes object, so the last one parsed is recognised by identity (bytes never change, and
        the object held here cannot be freed and its id reused). Readers never change what it gives.
        A body over PARSED_KEPT_MAX is not held past its request."""
        last, data = self._parsed
        if body is last:
            return data
        data = json_or_none(body)
        if len(body) <= PARSED_KEPT_MAX:
            self._parsed = (body, data)
        return data

    service_unit = "ollama.service"

    def load_seconds(self, answer_tail: bytes) -> float | None:
        """`load_duration` (ns) on the final line of a generation, chat or embed answer."""
        return ollama_load_seconds(answer_tail)

    def model_files(self, hints: FileHints) -> TenantFiles:
        """Ollama's store (manifests and blobs) under OLLAMA_MODELS or its user's home, or model_paths."""
        return ollama_tenant_files(self.tenant, hints)

    def classify(self, method: str, path: str) -> RequestKind:
        if method.upper() == "POST" and path.rstrip("/") in GPU_ROUTES:
            return "gpu"
        return "passthrough"

    def unload_target(self, path: str, body: bytes) -> str | None:
        work = UNLOAD_ROUTES.get(path.rstrip("/"))
        if work is None or b"keep_alive" not in body:  # cheap filter: most requests never set it
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("model"), str) or data.get(work):
            return None
        return data["model"] if keep_alive_is_zero(data.get("keep_alive")) else None

    def stream_format(self, path: str, body: bytes) -> Streamed | None:
        """`/api/chat` and `/api/generate` stream unless `stream` is false (engine-wire-facts A.2), the
        /v1 chat and completions only when `stream` is true. A load or unload (no messages, no prompt)
        answers one JSON object even with stream on: not streamed."""
        route = path.rstrip("/")
        fmt = _STREAMS.get(route)
        if fmt is None:
            return None
        data = self._request_json(body)
        if not isinstance(data, dict) or not isinstance(data.get("model"), str) or not data["model"]:
            return None
        if fmt.startswith("sse"):
            wanted = data.get("stream") is True
        else:
            wanted = data.get("stream", True) is not False and bool(data.get("messages" if fmt == "ndjson-chat" else "prompt"))
        return Streamed(fmt, data["model"]) if wanted else None

    def host_policy(self) -> HostPolicy:
        """allowedHostsMiddleware, mirrored: what Ollama allows, plus the tenant's allowed_hosts.
        Ollama checks Host only when bound to loopback; one on another address checks none, and
        neither does a drop-in in front of it that listens off loopback itself."""
        engine_checks = is_loopback_host(urlsplit(self.tenant.upstream or "http://127.0.0.1").hostname or "")
        return listener_policy(self.listen_host(), self.tenant.allowed_hosts, engine_rule=True,
                               engine_checks=engine_checks)

    # -- memory ---------------------------------------------------------------------------------
    def load_key(self, model: str) -> str:
        """The model's slot: every load of it (any content, any load options) is `<slot>?<variant>`."""
        return f"{self.tenant.name}:{canonical(model)}"

    def _shaped_key(self, model: str, digest: str | None, shape: tuple[tuple[str, str], ...]) -> str:
        """One load: the model's content and load options. Ollama holds one of a model at a time and
        reloads it for another (`Residency` treats the variants of a slot so)."""
        rest = variant(digest, shape)
        return f"{self.load_key(model)}?{rest}" if rest else self.load_key(model)

    def placement_key(self, placement: Placement) -> str:
        return self._shaped_key(str(placement.get("name")), _digest_of(placement), self.sizes.row_shape(placement))

    def keep_state_in(self, folder: Path | None) -> None:
        """Footprints outlive a restart: `<folder>/<tenant>.footprints.json`."""
        self.sizes.keep_in(folder / f"{self.tenant.name}.footprints.json" if folder is not None else None)

    async def estimate_need(self, path: str, body: bytes, client: httpx.AsyncClient) -> Need:
        """What Ollama reported this load (content and load options) took, else the model's size on
        disk plus the context allowance, unless configured per model."""
        tenant = self.tenant
        data = self._request_json(body)
        if not (isinstance(data, dict) and isinstance(data.get("model"), str)):
            return await super().estimate_need(path, body, client)
        model = canonical(data["model"])
        shape = load_shape(data)
        override = tenant.model_vram_gb.get(model, tenant.model_vram_gb.get(data["model"]))
        try:
            size = await self.sizes.size_of(tenant, client, model)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cannot read Ollama's model sizes: %s", exc)
            size = None
        key = self._shaped_key(model, self.sizes.digests.get(model), shape)
        if override is not None:
            return Need(int(override * GIB), f"{model} ({override:.2f} GiB, configured)", key, model)
        opts = f" with {', '.join(f'{k} {v}' for k, v in shape)}" if shape else ""
        seen = self.sizes.footprint(model, shape)
        prior = size + tenant.context_allowance_bytes if size is not None else None
        if seen is not None and seen.spilled:
            # Ollama split it across the GPU and the CPU at this size: the whole of it needs at least that
            total = max(seen.bytes, prior or 0)
            return Need(total, f"{model}{opts} ({total / GIB:.2f} GiB: Ollama split it with the CPU at "
                        f"{seen.bytes / GIB:.2f} GiB)", key, model)
        if seen is not None:
            # what Ollama said it took when it last held this load: no allowance to guess (a guess
            # above it made the proxy release an idle ComfyUI the card could keep beside it)
            total = max(seen.bytes, size or 0)
            return Need(total, f"{model}{opts} ({total / GIB:.2f} GiB, as Ollama reported it loaded)", key, model)
        if size is not None and prior is not None:
            return Need(prior, f"{model}{opts} ({size / GIB:.2f} GiB + {tenant.context_allowance_gb:.2f} GiB "
                        "context allowance)", key, model)
        return Need(tenant.needs_vram_bytes, f"{model}{opts} (size unknown: tenant need {tenant.needs_vram_gb:.2f} GiB)",
                    key, model)

    def response_is_oom(self, status: int, body: bytes) -> bool:
        if status < 400:
            return False
        data = json_or_none(body)
        message = data.get("error") if isinstance(data, dict) else None
        if isinstance(message, dict):  # the /v1 error shape
            message = message.get("message")
        return isinstance(message, str) and ollama_error_is_oom(message)

    async def self_reported_bytes(self, client: httpx.AsyncClient) -> int | None:
        try:
            r = await client.get(f"{upstream_of(self.tenant)}/api/ps")
            return sum(int(m.get("size_vram", 0)) for m in r.json().get("models") or [])
        except (httpx.HTTPError, ValueError, ReleaseFailed, AttributeError, TypeError):
            return None

    async def catalog(self, client: httpx.AsyncClient, timeout_s: float) -> TenantCatalog | None:
        if not self.tenant.upstream:
            return None
        r = await client.get(f"{self.tenant.upstream.rstrip('/')}/api/tags", timeout=timeout_s)
        r.raise_for_status()
        self.sizes.saw_tags(r.json().get("models") or [])
        models = [CatalogModel(name=str(m.get("name")), size_bytes=int(m["size"]) if m.get("size") is not None else None)
                  for m in r.json().get("models") or []]
        return TenantCatalog(engine=self.tenant.engine, models=sorted(models, key=lambda m: m.name))

    async def installed_needs(self, client: httpx.AsyncClient) -> list[tuple[str, int]]:
        tenant = self.tenant
        r = await client.get(upstream_of(tenant) + "/api/tags")
        r.raise_for_status()
        self.sizes.saw_tags(r.json().get("models") or [])
        needs = []
        for m in r.json().get("models") or []:
            name, size = str(m["name"]), int(m["size"])
            override = tenant.model_vram_gb.get(name)
            needs.append((name, int(override * GIB) if override is not None else size + tenant.context_allowance_bytes))
        return needs

    async def placements(self, client: httpx.AsyncClient) -> list[Placement]:
        """Ollama's loaded models (`/api/ps`), each with `size`, `size_vram` and `expires_at`."""
        r = await client.get(f"{upstream_of(self.tenant)}/api/ps")
        r.raise_for_status()
        models = [m for m in r.json().get("models") or [] if isinstance(m, dict) and isinstance(m.get("name"), str)]
        self.sizes.saw_loaded(models)
        return models

    # -- health and /api/engines ----------------------------------------------------------------
    def version_from_probe(self, data: object) -> str | None:
        version = data.get("version") if isinstance(data, dict) else None
        return version if isinstance(version, str) else None

    async def settings_view(self, client: httpx.AsyncClient, snap: AttributedSnapshot | None, env: es.EnvReaders,
                            host_reads: bool) -> es.OllamaReport:
        tenant = self.tenant
        reachable, error = False, None
        version: str | None = None
        if tenant.upstream:
            try:
                r = await client.get(tenant.upstream + "/api/version")
                reachable = True
                data = r.json() if r.status_code == 200 else None
                version = data.get("version") if isinstance(data, dict) and isinstance(data.get("version"), str) else None
            except httpx.HTTPError as exc:
                error = f"cannot reach {tenant.upstream}: {type(exc).__name__}: {exc}"
            except ValueError:
                pass
        reads: list[es.EnvRead] = []
        systemd: es.EnvRead | None = None
        environ: es.EnvRead | None = None
        if host_reads:
            systemd = await asyncio.to_thread(es.read_systemd_env, self.service_unit, env.systemctl, env.timeout_s)
            reads.append(systemd)
            procs = snap.processes_of(tenant.name) if snap else ()
            if snap is None or snap.estimated:
                environ = es.EnvRead("environ", None, "the GPU reader failed, so no process of "
                                     f"{tenant.name} can be found by attribution: its environment was not read", "")
            elif procs:
                # The server and its runners share the environment that matters; prefer `ollama serve`.
                proc = min(procs, key=lambda p: (0 if "serve" in p.process.cmdline else 1, p.process.pid)).process
                environ = await asyncio.to_thread(es.read_proc_environ, proc.pid, env.proc_root)
            else:
                environ = es.EnvRead("environ", None, f"no {tenant.name} process on the GPU (nothing loaded): "
                                     "its environment cannot be found by attribution", "")
            reads.append(environ)
        sources = [es.EnvSource.of(r) for r in reads] or [es.EnvSource(
            source="host", where="", ok=False, variables=None,
            error="simulated GPU: the host's systemd and /proc are not the simulated engines'")]
        return es.OllamaReport(tenant=tenant.name, engine=tenant.engine, upstream=tenant.upstream, reachable=reachable,
                               error=error, version=version, env_sources=sources,
                               settings=es.ollama_settings(systemd, environ, version))

    # -- what passes through -----------------------------------------------------------------------
    def model_news(self, method: str, path: str) -> bool:
        """A pull, copy, create or delete changes what a name is; a list of the models says it."""
        route = (method.upper(), path.rstrip("/"))
        return route in _NEWS

    def saw_model_news(self, method: str, path: str, request: bytes, status: int, answer: bytes) -> None:
        route = path.rstrip("/")
        if route == "/api/tags":
            data = json_or_none(answer)
            if status == 200 and isinstance(data, dict) and isinstance(data.get("models"), list):
                self.sizes.saw_tags(data["models"])
            return
        if status >= 400:
            return
        data = json_or_none(request)
        field = "destination" if route == "/api/copy" else "model"
        name = data.get(field) or (data.get("name") if field == "model" else None) if isinstance(data, dict) else None
        self.sizes.forget(name if isinstance(name, str) and name else None)  # unreadable: every name

    def saw_gpu_answer(self, path: str, body: bytes, status: int) -> None:
        """An answer under 400 to a request that loads: Ollama holds the model with its load options now."""
        data = self._request_json(body)
        if status < 400 and isinstance(data, dict) and isinstance(data.get("model"), str) and data["model"]:
            self.sizes.answered(data["model"], load_shape(data))

    async def unload_model(self, client: httpx.AsyncClient, model: str) -> bool:
        """keep_alive 0 with nothing to run: Ollama unloads it (when its requests end)."""
        u = await client.post(f"{upstream_of(self.tenant)}/api/generate", json={"model": model, "keep_alive": 0})
        return u.status_code < 400

    def relocation(self, port: int) -> Relocation:
        """OLLAMA_HOST sets where `ollama serve` listens; the Linux installer's unit is ollama.service."""
        return Relocation(port=port, service=self.service_unit, environment={"OLLAMA_HOST": f"127.0.0.1:{port}"},
                          instruction=f"OLLAMA_HOST=127.0.0.1:{port} ollama serve")


_NEWS = frozenset({("POST", "/api/pull"), ("POST", "/api/copy"), ("POST", "/api/create"), ("DELETE", "/api/delete"),
                   ("GET", "/api/tags")})


def _digest_of(placement: Placement) -> str | None:
    d = placement.get("digest")
    return d.removeprefix("sha256:") if isinstance(d, str) and d else None


class OllamaUnload(ReleaseSpec):
    """Release kind `ollama_unload`: every loaded model unloaded with keep_alive 0 (Ollama frees
    a model's memory when its keep_alive ends; 0 ends it now)."""

    kind: Literal["ollama_unload"] = "ollama_unload"

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        r = await client.get(f"{upstream_of(tenant)}/api/ps")
        r.raise_for_status()
        models = [m["name"] for m in r.json().get("models") or []]
        for name in models:
            u = await client.post(f"{upstream_of(tenant)}/api/generate", json={"model": name, "keep_alive": 0})
            if u.status_code >= 400:
                raise ReleaseFailed(f"Ollama refused to unload {name}: {u.status_code} {u.text[:200]}")
        return {"call": "keep_alive 0", "models": models}
