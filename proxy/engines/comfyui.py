"""ComfyUI: POST /prompt queues GPU work that outlives the HTTP response.

A prompt is busy from the POST /prompt answer ({"prompt_id": P, ...}) until the websocket frame
{"type":"executing","data":{"node":null,"prompt_id":P}} or until /history/P lists it.
Host/Origin: the base same-origin rewrite (see EngineAdapter.rewrite_origin) matches ComfyUI's
origin_only_middleware, which 403s when a loopback Host differs from the Origin's host:port.
Memory: an OOM arrives as an `execution_error` frame (or in the /history entry), /system_stats
reports the torch device (self-report, device figures, `--cpu`), /models/checkpoints is the catalog.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import httpx
from pydantic import Field

from proxy.config.schema import ReleaseSpec, Tenant
from proxy.config.units import GIB
from proxy.engines import settings as es
from proxy.engines.base import EngineAdapter
from proxy.engines.common import Need, ReleaseFailed, json_or_none, upstream_of
from proxy.engines.model_files import FileHints, TenantFiles, comfyui_tenant_files
from proxy.engines.ports import (
    CatalogModel,
    JobFrame,
    JobFrameKind,
    JobReplay,
    JobView,
    Relocation,
    RequestKind,
    Requeued,
    TenantCatalog,
)
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory

PROMPT_ROUTES = frozenset({"/prompt", "/api/prompt"})
QUEUE_ROUTES = frozenset({"/queue", "/api/queue"})  # POST {"delete": [...]} / {"clear": true}
HISTORY_ROUTES = ("/history", "/api/history")  # GET, and /history/{prompt_id}
JOBS_ROUTE = "/api/jobs"  # GET, and /api/jobs/{job_id} (0.8.0: the queue and the history as one list)
# ComfyUI classifies only torch's OOM exception as OOM (model_management.OOM_EXCEPTION).
COMFY_OOM_TYPES = ("torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError")


def comfy_event_is_oom(event: Mapping[str, object]) -> bool:
    data = event.get("data")
    return (event.get("type") == "execution_error" and isinstance(data, dict)
            and data.get("exception_type") in COMFY_OOM_TYPES)


def _int(value: object) -> int | None:
    """A figure in ComfyUI's JSON (a number, or a number as text); None when it is none."""
    if not isinstance(value, int | float | str):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):
        return None


def _on_cpu(dev: Mapping[str, object]) -> bool:
    """ComfyUI started with --cpu lists device type "cpu": its "vram" figures are host RAM."""
    return dev.get("type") == "cpu"


class ComfyUIAdapter(EngineAdapter):
    kind = "comfyui"
    probe_path = "/system_stats"
    ready_path = "/system_stats"  # served once the prompt server runs (custom nodes loaded)
    starts_loaded = False  # checkpoints load per prompt
    probe_strict = True
    verify_role = "renders"
    start_hint = "start ComfyUI (`python main.py`)"
    floor_from_samples = True
    device_flag = "--cuda-device"  # main.py sets CUDA_VISIBLE_DEVICES from it before torch starts
    load_timed_from_frames = True  # a prompt's checkpoint loads when its job runs, after /prompt answered
    runs_at_once_default = 1  # one prompt executes at a time; the rest wait in its queue
    head_model_fields = ("ckpt_name", "unet_name")  # the checkpoint a prompt's loader nodes load

    def body_naming(self, model: str) -> bytes:
        return json.dumps({"prompt": {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": model}}}}).encode()

    def model_files(self, hints: FileHints) -> TenantFiles:
        """ComfyUI's model folders (checkpoints, vae, ...) under its base directory and extra_model_paths."""
        return comfyui_tenant_files(self.tenant, hints)

    def classify(self, method: str, path: str) -> RequestKind:
        if method.upper() == "POST" and path.rstrip("/") in PROMPT_ROUTES:
            return "gpu"
        return "passthrough"

    def captures_job(self, method: str, path: str) -> bool:
        return self.classify(method, path) == "gpu"

    def job_id_from_response(self, status: int, body: bytes) -> str | None:
        data = _ok_json(status, body)
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        return pid if isinstance(pid, str) and pid else None

    def job_done_from_frame(self, text: str) -> str | None:
        if "executing" not in text:  # cheap filter: most frames are progress/status
            return None
        try:
            msg = json.loads(text)
        except ValueError:
            return None
        if not isinstance(msg, dict) or msg.get("type") != "executing":
            return None
        data = msg.get("data")
        if isinstance(data, dict) and "node" in data and data["node"] is None:
            pid = data.get("prompt_id")
            return pid if isinstance(pid, str) else None
        return None

    def history_path(self, job_id: str) -> str | None:
        return f"/history/{job_id}"

    def job_done_from_history(self, job_id: str, status: int, body: bytes) -> bool:
        # /history/{id} is {} until the prompt finished (success, error or interrupt).
        if status != 200:
            return False
        try:
            data = json.loads(body)
        except ValueError:
            return False
        return isinstance(data, dict) and job_id in data

    def queue_path(self) -> str | None:
        return "/queue"

    def job_ids_from_queue(self, status: int, body: bytes) -> frozenset[str] | None:
        # {"queue_running": [[number, prompt_id, graph, extra, outputs], ...], "queue_pending": [...]}
        data = _ok_json(status, body)
        if not isinstance(data, dict):
            return None
        ids: set[str] = set()
        for section in ("queue_running", "queue_pending"):
            rows = data.get(section)
            if not isinstance(rows, list):
                return None
            ids.update(row[1] for row in rows if isinstance(row, list) and len(row) > 1 and isinstance(row[1], str))
        return frozenset(ids)

    def job_news(self, method: str, path: str) -> bool:
        """A queue delete or clear (POST /queue), or a client polling /history or /queue for its
        prompt's end: the proxy checks its tracked jobs right after, so it hears an end when the
        client does instead of at its own next poll (a swap away from ComfyUI waited up to job_poll_s)."""
        route, verb = path.rstrip("/"), method.upper()
        if verb == "POST":
            return route in QUEUE_ROUTES
        return verb == "GET" and (route in QUEUE_ROUTES or route in HISTORY_ROUTES
                                  or route.startswith(tuple(f"{r}/" for r in HISTORY_ROUTES)))

    # -- memory ---------------------------------------------------------------------------------
    async def estimate_need(self, path: str, body: bytes, client: httpx.AsyncClient) -> Need:
        """A checkpoint with a configured size (model_vram_gb) needs that; else the tenant's need."""
        tenant = self.tenant
        data = json_or_none(body)
        if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
            named: str | None = None  # the checkpoint it loads, for the model files (proxy/models)
            for node in data["prompt"].values():
                ckpt = isinstance(node, dict) and (node.get("inputs") or {}).get("ckpt_name")
                if isinstance(ckpt, str) and ckpt in tenant.model_vram_gb:
                    gb = tenant.model_vram_gb[ckpt]
                    return Need(int(gb * GIB), f"{ckpt} ({gb:.2f} GiB, configured)", self.load_key(ckpt), ckpt)
                named = named or (ckpt if isinstance(ckpt, str) else None)
            # keyed by the checkpoint it names (its residency, its reservation, its learned peak, the models
            # gauge's name): a render of another one is no resident load (ComfyUI swaps it in); a graph that
            # names none is the tenant's one load
            key = self.load_key(named) if named is not None else tenant.name
            return Need(tenant.needs_vram_bytes, f"{tenant.needs_vram_gb:.2f} GiB (needs_vram_gb)", key, named)
        return await super().estimate_need(path, body, client)

    def oom_in_history(self, job_id: str, body: bytes) -> bool:
        """ComfyUI keeps the execution_error in the history entry's status messages."""
        if b"execution_error" not in body or b"OutOfMemoryError" not in body:
            return False
        try:
            entry = json.loads(body).get(job_id) or {}
            messages = entry.get("status", {}).get("messages") or []
        except (ValueError, AttributeError):
            return False
        return any(isinstance(message, list) and len(message) == 2 and isinstance(message[1], dict)
                   and comfy_event_is_oom({"type": message[0], "data": message[1]}) for message in messages)

    async def job_replay(self, client: httpx.AsyncClient, job_id: str) -> JobReplay | None:
        """The prompt's graph and extra data from /history/{id} (ComfyUI writes history before its end
        marker), to be queued again under its own id (`prompt_id` in the body, taken since 2025-07) for
        the same client, so its history, queue and websocket frames name the prompt the client knows."""
        try:
            r = await client.get(f"{upstream_of(self.tenant)}/history/{job_id}")
            item = r.json().get(job_id) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError, ReleaseFailed):
            return None
        if not (isinstance(item, dict) and isinstance(item.get("prompt"), list) and len(item["prompt"]) >= 4):
            return None
        graph, extra = item["prompt"][2], item["prompt"][3]
        if not (isinstance(graph, dict) and isinstance(extra, dict)):
            return None
        payload: dict[str, object] = {"prompt": graph, "extra_data": extra, "prompt_id": job_id}
        if extra.get("client_id"):
            payload["client_id"] = extra["client_id"]  # its websocket sees the new prompt's progress
        return JobReplay(json.dumps({"prompt": graph}).encode(), payload, job_id, item["prompt"][:5])

    async def resubmit(self, client: httpx.AsyncClient, replay: JobReplay) -> Requeued:
        r = await client.post(f"{upstream_of(self.tenant)}/prompt", json=replay.payload)
        data = _ok_json(r.status_code, r.content)
        new_id = data.get("prompt_id") if isinstance(data, dict) else None
        number = data.get("number") if isinstance(data, dict) else None
        return Requeued(new_id if isinstance(new_id, str) and new_id else None, r.status_code,
                        _mark(number) if isinstance(number, int | float) else None)

    def job_frame(self, text: str) -> JobFrame | None:
        """execution_start, execution_success, execution_error (OOM or not), execution_interrupted,
        and the end marker `executing` with node null; progress frames are skipped unread."""
        if "execution_" not in text and '"executing"' not in text:
            return None
        try:
            msg = json.loads(text)
        except ValueError:
            return None
        if not isinstance(msg, dict) or not isinstance(data := msg.get("data"), dict):
            return None
        pid = data.get("prompt_id")
        if not isinstance(pid, str) or not pid:
            return None
        match msg.get("type"):
            case "execution_start":
                return JobFrame("start", pid)
            case "execution_success":
                return JobFrame("success", pid)
            case "execution_error":
                return JobFrame("oom" if comfy_event_is_oom(msg) else "error", pid)
            case "execution_interrupted":
                return JobFrame("error", pid)
            case "executing" if "node" in data and data["node"] is None:
                return JobFrame("end", pid)
        return None

    def job_view(self, method: str, path: str) -> JobView | None:
        route = path.rstrip("/")
        if method.upper() != "GET":
            return None
        if route in HISTORY_ROUTES or route.startswith(tuple(f"{r}/" for r in HISTORY_ROUTES)):
            return "history"
        if route == JOBS_ROUTE or route.startswith(JOBS_ROUTE + "/"):
            return "jobs"
        return "queue" if route in QUEUE_ROUTES else None

    def jobs_without(self, body: bytes, hidden: Callable[[str, str | None], bool],
                     retried: Sequence[JobReplay]) -> bytes | None:
        """GET /api/jobs (0.8.0): {"jobs": [job...], "pagination": {...}}, and /api/jobs/{id}: one job,
        looked up in the history first. A finished job's `priority` is its record's queue number: a
        failed run hidden leaves the list, and as the one job asked for reads as the queue lists the
        job (pending, with what its record kept)."""
        data = _ok_json(200, body)
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("jobs"), list):
            jobs = data["jobs"]
            kept = [j for j in jobs if not _hidden_job(j, hidden)]
            if len(kept) == len(jobs):
                return None
            data["jobs"] = kept
            pagination = data.get("pagination")
            if isinstance(pagination, dict) and isinstance(pagination.get("total"), int):
                pagination["total"] -= len(jobs) - len(kept)
            return json.dumps(data).encode()
        if not _hidden_job(data, hidden):
            return None
        row = next((r.row for r in retried if r.job_id == data.get("id") and isinstance(r.row, list)), None)
        return json.dumps(_pending_job(data["id"], row)).encode()

    def queue_with(self, body: bytes, pending: Sequence[JobReplay]) -> bytes | None:
        """GET /queue: {"queue_running": [rows], "queue_pending": [rows]}; each job not listed goes
        pending, as the row its history record kept ([number, prompt_id, graph, extra_data, outputs])."""
        data = _ok_json(200, body)
        listed = self.job_ids_from_queue(200, body)
        if not isinstance(data, dict) or listed is None or not isinstance(data.get("queue_pending"), list):
            return None
        rows = [r.row for r in pending if r.job_id not in listed and isinstance(r.row, list)]
        if not rows:
            return None
        data["queue_pending"] = [*data["queue_pending"], *rows]
        return json.dumps(data).encode()

    def history_outcome(self, job_id: str, body: bytes) -> JobFrameKind | None:
        try:
            entry = json.loads(body).get(job_id)
        except (ValueError, AttributeError):
            return None
        if not isinstance(entry, dict):
            return None
        if self.oom_in_history(job_id, body):
            return "oom"
        status = entry.get("status")
        return "success" if isinstance(status, dict) and status.get("status_str") == "success" else "error"

    def history_without(self, body: bytes, hidden: Callable[[str, str | None], bool]) -> bytes | None:
        """GET /history and /history/{id} answer {prompt_id: record, ...}; a record hidden is left out
        (for /history/{id} that is `{}`, what ComfyUI answers while the prompt has not finished)."""
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        kept = {k: v for k, v in data.items() if not hidden(k, _record_mark(v))}
        return json.dumps(kept).encode() if len(kept) < len(data) else None

    async def _torch_device(self, client: httpx.AsyncClient) -> dict[str, object] | None:
        """The first (torch) device of ComfyUI's /system_stats; None when unreadable."""
        try:
            r = await client.get(f"{upstream_of(self.tenant)}/system_stats")
            dev = (r.json().get("devices") or [{}])[0]
        except (httpx.HTTPError, ValueError, TypeError, AttributeError, IndexError, ReleaseFailed):
            return None
        return dev if isinstance(dev, dict) else None

    async def self_reported_bytes(self, client: httpx.AsyncClient) -> int | None:
        dev = await self._torch_device(client)
        if dev is None:
            return None
        if _on_cpu(dev):
            return 0  # torch_vram_total is host RAM there: it holds no VRAM at all
        held = _int(dev.get("torch_vram_total", 0))
        return None if held is None else held + self.tenant.idle_vram_bytes

    async def device_report(self, client: httpx.AsyncClient) -> DeviceMemory | None:
        """ComfyUI's device-wide figures (cudaMemGetInfo), for when NVML is broken. None on the CPU:
        host RAM is not a card."""
        dev = await self._torch_device(client)
        if dev is None or _on_cpu(dev):
            return None
        total, free = _int(dev.get("vram_total")), _int(dev.get("vram_free"))
        if total is None or free is None or total <= 0:
            return None
        # cudaMemGetInfo has no driver-reserved figure: that one stays unknown
        return DeviceMemory(_int(dev.get("index")) or 0, str(dev.get("name", "")), total, 0, total - free, free,
                            unknown=frozenset({"reserved"}))

    async def runs_on_cpu(self, client: httpx.AsyncClient) -> bool:
        if not self.tenant.upstream:
            return False
        dev = await self._torch_device(client)
        return dev is not None and _on_cpu(dev)

    async def catalog(self, client: httpx.AsyncClient, timeout_s: float) -> TenantCatalog | None:
        if not self.tenant.upstream:
            return None
        r = await client.get(f"{self.tenant.upstream.rstrip('/')}/models/checkpoints", timeout=timeout_s)
        r.raise_for_status()
        return TenantCatalog(engine=self.tenant.engine,
                             models=[CatalogModel(name=str(n), size_bytes=None) for n in sorted(r.json())])

    async def running_jobs(self, client: httpx.AsyncClient) -> list[str]:
        r = await client.get(f"{upstream_of(self.tenant)}/queue")
        r.raise_for_status()
        return [item[1] for item in r.json().get("queue_running") or [] if isinstance(item, list) and len(item) > 1]

    # -- health and /api/engines ----------------------------------------------------------------
    def version_from_probe(self, data: object) -> str | None:
        return es.parse_system_stats(data).version

    def status_websocket(self, client_id: str) -> str | None:
        if not self.tenant.upstream:
            return None
        url = self.tenant.upstream.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        return f"{url}/ws?clientId={client_id}"

    def is_status_frame(self, text: str | bytes) -> bool:
        """{"type": "status", "data": {"sid": ..., "status": {...}}}: ComfyUI's greeting."""
        try:
            frame = json.loads(text)
        except (TypeError, ValueError):
            return False
        data = frame.get("data") if isinstance(frame, dict) else None
        return isinstance(data, dict) and frame.get("type") == "status" and bool(data.get("sid"))

    async def settings_view(self, client: httpx.AsyncClient, snap: AttributedSnapshot | None, env: es.EnvReaders,
                            host_reads: bool) -> es.ComfyReport:
        tenant = self.tenant
        reachable, error = False, None
        stats = es.parse_system_stats(None)
        if tenant.upstream:
            try:
                r = await client.get(tenant.upstream + "/system_stats")
                reachable = True
                try:
                    stats = es.parse_system_stats(r.json())
                except ValueError:
                    error = f"/system_stats answered {r.status_code} without JSON"
            except httpx.HTTPError as exc:
                error = f"cannot reach {tenant.upstream}: {type(exc).__name__}: {exc}"
        return es.ComfyReport(
            tenant=tenant.name, engine=tenant.engine, upstream=tenant.upstream, reachable=reachable, error=error,
            **stats.model_dump(), flags=es.comfy_flags(stats.argv or ()),
            flags_note="system_stats has no argv (older ComfyUI): start flags unknown"
            if stats.argv is None and reachable else None)

    def relocation(self, port: int) -> Relocation:
        """ComfyUI ships no service: its `--port` flag (with `--listen` left at its 127.0.0.1 default)."""
        return Relocation(port=port, instruction=f"python main.py --port {port}")


def _hidden_job(job: object, hidden: Callable[[str, str | None], bool]) -> bool:
    if not (isinstance(job, dict) and isinstance(job.get("id"), str) and job.get("status") in ("failed", "completed")):
        return False
    priority = job.get("priority")
    return hidden(job["id"], _mark(priority) if isinstance(priority, int | float) else None)


def _pending_job(job_id: str, row: list[object] | None) -> dict[str, object]:
    """A queued job as the jobs API lists one (None values left out, as its prune_dict does)."""
    extra = row[3] if row is not None and len(row) > 3 and isinstance(row[3], dict) else {}
    workflow = ((extra.get("extra_pnginfo") or {}).get("workflow") or {}) if isinstance(extra, dict) else {}
    job = {"id": job_id, "status": "pending", "priority": row[0] if row else None, "create_time": extra.get("create_time"),
           "outputs_count": 0, "workflow_id": workflow.get("id") if isinstance(workflow, dict) else None}
    return {k: v for k, v in job.items() if v is not None}


def _mark(number: float) -> str:
    """A queue number as a record's mark: 3 and 3.0 are the same run."""
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def _record_mark(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return None
    prompt = entry.get("prompt")
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int | float)):
        return None
    return _mark(prompt[0])


def _ok_json(status: int, body: bytes) -> object:
    """The JSON of a 200 answer; None for any other status or a body that is not JSON."""
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


class ComfyUIFree(ReleaseSpec):
    """Release kind `comfyui_free`: POST /free, which unloads ComfyUI's models and frees its cache."""

    kind: Literal["comfyui_free"] = "comfyui_free"
    unload_models: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to unload its models")
    free_memory: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to free its cached memory too")

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        payload = {"unload_models": self.unload_models, "free_memory": self.free_memory}
        r = await client.post(f"{upstream_of(tenant)}/free", json=payload)
        if r.status_code >= 400:
            raise ReleaseFailed(f"ComfyUI refused /free: {r.status_code}")
        return {"call": "POST /free", **payload}
