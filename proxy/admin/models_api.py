"""Model files in RAM, as an admin extension: `/api/models` (each tenant's models with size and
page-cache residency), warming one (`POST /api/models/warm`) and stopping a warm
(`POST /api/models/stop`), `/api/models/loads` (load speeds, warm or cold), a health entry, and what
it hears of loads (a `LoadListener` of proxy/handoff/load_events.py, never a hook in the gate): warm
the next model's files while the other tenant releases (`load_ahead`), and time each load from the
engine's own answer (`load_starting` reads the files' residency, `load_ended` the engine's figure)
or from its execution frames (`engine_frame`).

ProxyView attributes used: registry, broker (last_snapshot, loads), decisions, token, extension("health")
(to add a health check). Everything that touches the disk runs off the loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.proxy_view import ProxyView
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.engines import EngineAdapter, adapter_for
from proxy.engines.model_files import ModelFiles, files_summary
from proxy.engines.settings import read_proc_environ
from proxy.errors import HyperSwapError, error_body
from proxy.handoff.decisions import ModelLoad
from proxy.handoff.load_events import Load
from proxy.handoff.load_events import progress as load_progress
from proxy.models.catalog import ModelCatalog
from proxy.models.fileio import FileWorkBusy
from proxy.models.frames import FrameTimer, loader_nodes
from proxy.models.loads import MIN_LOAD_S, LoadLog, LoadRecord, LoadSplit, MeasuredLoad
from proxy.models.pagecache import PageCacheProbe, Residency, SystemPageCache
from proxy.models.warm import MemAvailable, Warm, Warmer, WarmJob, may_read, read_mem_available

if TYPE_CHECKING:
    from proxy.admin.health_entry import HealthEntry
    from proxy.gpu.attribution import AttributedSnapshot

log = logging.getLogger("hyperswap.models")

LOOKUP_S = 1.0  # a GPU request waits at most this for its model's files; past it the load is just not timed
WATCH_EVERY_S = 0.5  # a load whose client left is timed from the card read this often ...
WATCH_FOR_S = 600.0  # ... for at most this long
SETTLED_SLACK = 0.01  # of the need: a reading that grew less has settled
LOADED_SHARE = 0.9  # of the need (its estimate includes a context allowance): settled there, it is loaded
ANSWER_S = 15.0  # an admin answer that needs the model files waits at most this, then says 503
BUSY_FIX = "retry in a few seconds; if it persists, look for a model folder on a slow or hung file system"
SKIPPED_SHOWN = 5
T = TypeVar("T")


def _error(status: int, message: str, fix: str, **details: object) -> JSONResponse:
    return JSONResponse(error_body(message, fix, details), status_code=status)


class ModelsExtension:
    name = "models"

    def __init__(self, proxy: ProxyView, *, probe: PageCacheProbe | None = None,
                 mem_available: MemAvailable = read_mem_available, env: dict[str, str] | None = None,
                 home: Path | None = None, proc_root: Path = Path("/proc")) -> None:
        self.proxy = proxy
        self.settings = proxy.registry.config.proxy
        self.proc_root = proc_root
        self.catalog = ModelCatalog(proxy.registry, probe or SystemPageCache(), cmdlines=self._cmdlines,
                                    env=env, home=home, engine_env=self._engine_env)
        self.mem_available = mem_available
        self.warmer = Warmer(self.margin_bytes, mem_available, self.catalog.files_changed)
        self.loads = LoadLog()
        self.recent: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (tenant, model), newest last
        self._tasks: set[asyncio.Task[object]] = set()
        # tenant -> checkpoint loads expected in its execution frames: (files, residency before, source, request)
        self._frames: dict[str, FrameTimer[tuple[ModelFiles, float | None, str, int | None]]] = {}
        self._starting: dict[int, tuple[ModelFiles, float | None]] = {}  # load id -> its files, residency before
        self._unsubscribe: Callable[[], None] | None = None

    def margin_bytes(self) -> int:
        return int(self.settings.warm_margin_gb * GIB)

    def _cmdlines(self, tenant: str) -> list[str]:
        snap = self.proxy.broker.last_snapshot
        return [p.process.cmdline for p in snap.processes_of(tenant)] if snap is not None else []

    def _engine_env(self, tenant: Tenant) -> Mapping[str, str] | None:
        """The environment the tenant's engine runs with (where Ollama keeps its models is its own
        OLLAMA_MODELS and HOME, not the proxy's): /proc/<pid>/environ of one of its GPU processes (a
        runner inherits its server's). None when none is on the card, when the reader does not see
        this host's processes (a simulated GPU's pids are fictional), or when none can be read."""
        snap = self.proxy.broker.last_snapshot
        if snap is None or snap.snapshot.tree is None:
            return None
        for p in snap.processes_of(tenant.name):
            read = read_proc_environ(p.process.pid, self.proc_root)
            if read.values is not None:
                return read.values
        return None

    # -- extension ------------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [Route("/api/models", self.list_route, methods=["GET"]),
                Route("/api/models/warm", self._guarded(self.warm_route), methods=["POST"]),
                Route("/api/models/stop", self._guarded(self.stop_route), methods=["POST"]),
                Route("/api/models/loads", self.loads_route, methods=["GET"])]

    async def start(self) -> None:
        from proxy.admin.health import HealthExtension, NamedCheck
        self._unsubscribe = self.proxy.broker.loads.subscribe(self)
        self._spawn(self._quietly(self.catalog.all_files), "hyperswap:locate")  # before the first load
        health = self.proxy.extension("health")  # explicit lookup by name
        if isinstance(health, HealthExtension):
            health.checks.append(NamedCheck("model files", self.health_entries))

    async def files(self, fn: Callable[..., T], *args: object, timeout_s: float | None = ANSWER_S) -> T:
        """`fn(*args)` on the model-file threads (never the loop, never asyncio's default pool).
        Raises FileWorkBusy (queue full, or closed) or TimeoutError."""
        return await self.catalog.work.run(fn, *args, timeout_s=timeout_s)

    async def _quietly(self, fn: Callable[..., T], *args: object, timeout_s: float | None = ANSWER_S) -> T | None:
        try:
            return await self.files(fn, *args, timeout_s=timeout_s)
        except (FileWorkBusy, TimeoutError) as exc:
            log.info("model files: %s skipped (%s)", getattr(fn, "__name__", "work"), exc or "timed out")
            return None

    async def stop(self) -> None:
        self.catalog.work.close()  # nothing waits on a model-file read from here on
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.warmer.aclose()

    async def settled(self) -> None:
        """Until the background work started so far (locates, warms it asked for) is done: tests, benches."""
        while self._tasks or any(j.active for j in self.warmer.jobs.values()):
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for key in [k for k, j in self.warmer.jobs.items() if j.active]:
                await self.warmer.wait(key)

    def _spawn(self, coro: Awaitable[object], name: str) -> None:
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what it hears of loads (load_events.LoadListener) ----------------------------------------
    def load_ahead(self, tenant: str, model: str) -> None:
        self._used(tenant, model)
        if self.settings.warm_during_release:
            self._spawn(self._warm_quietly(tenant, model, "handoff: read while memory is released"),
                        f"hyperswap:prepare:{tenant}:{model}")

    async def _warm_quietly(self, tenant: str, model: str, reason: str) -> WarmJob | None:
        files = await self._quietly(self.catalog.find, tenant, model)
        if files is None:
            return None
        residency = await self._quietly(self.catalog.residency_of, files)
        if residency is None or (residency.fraction is not None and residency.fraction >= 0.999):
            return None  # already in RAM (or cannot be said now): nothing to read
        return self.warmer.start(files.key, files.files, files.size_bytes, reason, files.sizes)

    async def load_starting(self, load: Load) -> None:
        """Just before the load is forwarded: its files and their residency now (the load's warm or cold
        is told from it), within LOOKUP_S (the request never waits long for this)."""
        tenant = self.proxy.registry.get(load.tenant)
        adapter = adapter_for(tenant)
        self._used(load.tenant, load.model)
        if not adapter.load_timed_from_frames and type(adapter).load_seconds is EngineAdapter.load_seconds:
            return  # this engine does not say how long its loads take

        def look() -> tuple[ModelFiles | None, float | None]:  # off the loop: may walk directories
            files = self.catalog.find(load.tenant, load.model)
            return files, (self.catalog.residency_of(files).fraction if files is not None else None)

        found = await self._quietly(look, timeout_s=LOOKUP_S)
        files, before = found if found is not None else (None, None)
        if files is None:
            return
        if adapter.load_timed_from_frames:  # the load runs after the answer: its frames time it
            self._frames.setdefault(load.tenant, FrameTimer(time.monotonic)).expect(
                loader_nodes(load.body, load.model), (files, before, f"{adapter.kind} execution frames", load.request))
        else:
            self._starting[load.id] = (files, before)

    def load_ended(self, load: Load, tail: bytes | None) -> None:
        started = self._starting.pop(load.id, None)
        if started is None:
            return
        files, before = started
        adapter = adapter_for(self.proxy.registry.get(load.tenant))
        seconds = adapter.load_seconds(tail) if tail is not None else None
        source = f"{adapter.kind} load_duration"
        if seconds is None:  # the client left before the engine's last line: the proxy's own time, to its first byte
            seconds, source = self.proxy.broker.loads.answered_after(load), "until the engine's first byte"
        if seconds is None and tail is None:  # it left before any answer: the engine goes on loading
            self._spawn(self._seen_loaded(load, files, before), f"hyperswap:load-watch:{load.tenant}:{load.model}")
            return
        self._record_ended(load, files, before, seconds, source)

    async def _seen_loaded(self, load: Load, files: ModelFiles, before: float | None) -> None:
        """A load whose client left before the engine answered (Stop in a chat UI while it loads): the
        engine goes on loading it (Ollama's scheduler owns a load, not the request), so it is timed from
        the card: read every WATCH_EVERY_S until what the tenant gained stops growing at 90 % of the
        need or more (an engine that allocates in steps stands still between them, lower); loaded at
        the first reading of that figure (to within WATCH_EVERY_S). A request for the
        same load meanwhile times it itself (one load, one record); a figure that never settles, or
        falls, records nothing."""
        broker = self.proxy.broker
        clock = broker.loads.clock  # the clock its began_at was read on
        tenant = self.proxy.registry.get(load.tenant)
        settled: tuple[int, float] | None = None  # (the figure, when first read)
        deadline = clock.now() + WATCH_FOR_S
        while clock.now() < deadline:
            await clock.sleep(WATCH_EVERY_S)
            if broker.loads.underway_of(load.tenant, load.key) is not None:
                return
            snap = await broker.snapshot()
            gain = load_progress(load, snap.held_by(load.tenant), tenant.idle_vram_bytes, snap.estimated).on_card_bytes
            if settled is not None and gain < settled[0] - SETTLED_SLACK * load.need_bytes:
                return  # it fell: unloaded, or the load failed
            if settled is not None and gain <= settled[0] + SETTLED_SLACK * load.need_bytes:
                if settled[0] >= LOADED_SHARE * load.need_bytes:  # not a plateau between allocations
                    self._record_ended(load, files, before, settled[1] - load.began_at,
                                       "seen on the card (its client left before the answer)")
                    return
            else:
                settled = (gain, clock.now())

    def _record_ended(self, load: Load, files: ModelFiles, before: float | None, seconds: float | None,
                      source: str) -> None:
        if seconds is not None and seconds >= MIN_LOAD_S:
            # when the load ended: from its begin (the engine times it from the request's arrival), not the
            # answer's end, which a long streamed answer puts far past it (a request's waterfall draws it there)
            ended = min(time.time(), load.began_wall + seconds)
            self.record_load(LoadRecord(ended, load.tenant, files.name, self.model_size(files), seconds, before,
                                        source), files.files, load.request)

    def engine_frame(self, tenant: str, text: str) -> None:
        timer = self._frames.get(tenant)
        if timer is None or not timer.expected:
            return
        for (files, before, source, request), seconds in timer.on_frame(text):
            if seconds >= MIN_LOAD_S:
                self.record_load(LoadRecord(time.time(), tenant, files.name, self.model_size(files), seconds, before,
                                            source), files.files, request)

    def record_load(self, record: LoadRecord, paths: tuple[str, ...] = (), request: int | None = None) -> LoadRecord:
        record = self.loads.add(record)
        self.catalog.files_changed(paths)  # the engine read them: a reading from before the load is stale
        self.proxy.decisions.emit(ModelLoad(tenant=record.tenant, trigger=f"{record.model} loaded", load=record,
                                            request=request))
        self._keep_recent_warm()
        return record

    def _used(self, tenant: str, model: str) -> None:
        key = f"{tenant}:{model}"
        self.recent.pop(key, None)
        self.recent[key] = (tenant, model)
        while len(self.recent) > 100:
            self.recent.popitem(last=False)

    def _keep_recent_warm(self) -> None:
        """Optional policy (proxy.keep_warm_models = N): the N most recently used models stay in RAM."""
        n = self.settings.keep_warm_models
        for tenant, model in list(self.recent.values())[-n:] if n else []:
            self._spawn(self._warm_quietly(tenant, model, f"keep the {n} most recently used warm"),
                        f"hyperswap:keep-warm:{tenant}:{model}")

    # -- views ----------------------------------------------------------------------------------
    def model_size(self, m: ModelFiles) -> int:
        """What the model weighs: its files' size; on the demo's simulated box, whose files are small
        stand-ins, the size of the model they stand for (so its loads' GB/s are the model's)."""
        stands_for = [self.proxy.model_file_size(p) for p in m.files]
        known = [s for s in stands_for if s is not None]
        return sum(known) if known and len(known) == len(stands_for) else m.size_bytes

    def model_json(self, m: ModelFiles, files: bool = False) -> dict[str, object]:
        r = self.catalog.residency_of(m)
        job = self.warmer.jobs.get(m.key)
        size = self.model_size(m)
        return {"tenant": m.tenant, "name": m.name, "folder": m.folder, "key": m.key, "size_bytes": size,
                "size_gb": round(size / GIB, 3), "file_count": len(m.files),
                "residency": Residency.of(r, files).model_dump(mode="json"),
                "warm": Warm.of(job).model_dump(mode="json") if job else None}

    def listing(self, tenant: str | None) -> dict[str, object]:
        everything = self.catalog.all_files()
        tenants = []
        for name, found in everything.items():
            if tenant not in (None, name):
                continue
            tenants.append({"tenant": name, "layout": found.layout, "looked_in": list(found.looked_in),
                            "roots": found.located.roots, "unknown_reason": found.unknown_reason,
                            "problems": [asdict(p) for p in found.located.problems],
                            "skipped": [asdict(k) for k in found.located.skipped],
                            "models": [self.model_json(m) for m in found.located.models]})
        available = self.mem_available()
        return {"tenants": tenants, "mem_available_bytes": available, "warm_margin_bytes": self.margin_bytes(),
                "warming": [Warm.of(j).model_dump(mode="json") for j in self.warmer.jobs.values() if j.active],
                "method": getattr(self.catalog.residency.probe, "method", None)}

    # -- routes ---------------------------------------------------------------------------------
    def _guarded(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            token = self.proxy.token
            if token is not None:
                auth = request.headers.get("authorization", "")
                if not auth.lower().startswith("bearer "):
                    return _error(401, "this admin call needs a bearer token",
                                  "send `Authorization: Bearer <token>` (from HYPERSWAP_ADMIN_TOKEN or admin.token_file)")
                if not hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
                    return _error(403, "wrong admin token", "use the token the proxy was started with")
            try:
                return await handler(request)
            except HyperSwapError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        return wrapped

    async def list_route(self, request: Request) -> Response:
        tenant = request.query_params.get("tenant")
        if tenant is not None and tenant not in self.proxy.registry.tenants:
            return _error(404, f"no tenant {tenant!r}", "GET /api/tenants lists them", tenant=tenant)
        if self.proxy.broker.last_snapshot is None:
            await self.proxy.broker.snapshot()  # ComfyUI's folders come from its command line on the card
        try:
            return JSONResponse(await self.files(self.listing, tenant))
        except (FileWorkBusy, TimeoutError) as exc:
            return _busy(exc)

    async def _target(self, request: Request) -> tuple[ModelFiles | None, Response | None]:
        example = 'send {"tenant": "ollama", "model": "llama3.1:8b"} (GET /api/models lists them)'
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            return None, _error(400, "the body is not JSON", example)
        if (not isinstance(body, dict) or set(body) != {"tenant", "model"}
                or not all(isinstance(v, str) and v for v in body.values())):
            return None, _error(400, "the body must be an object with exactly a tenant and a model, both strings", example)
        if body["tenant"] not in self.proxy.registry.tenants:
            return None, _error(404, f"no tenant {body['tenant']!r}", "GET /api/tenants lists them", tenant=body["tenant"])
        if self.proxy.broker.last_snapshot is None:
            await self.proxy.broker.snapshot()
        try:
            files = await self.files(self.catalog.find, body["tenant"], body["model"])
        except (FileWorkBusy, TimeoutError) as exc:
            return None, _busy(exc)
        if files is None:
            return None, _error(404, f"{body['tenant']} has no model {body['model']!r} on disk", example,
                                tenant=body["tenant"], model=body["model"])
        return files, None

    async def warm_route(self, request: Request) -> Response:
        files, refused = await self._target(request)
        if files is None:
            return refused or _error(400, "no model named", "see GET /api/models")
        why = may_read(self.mem_available(), 0, self.margin_bytes())
        if why is not None:
            return _error(409, f"not warming {files.key}: {why}",
                          "free host memory, or lower proxy.warm_margin_gb in tenants.json", key=files.key)
        job = self.warmer.start(files.key, files.files, files.size_bytes, "admin", files.sizes)
        return JSONResponse({"warm": Warm.of(job).model_dump(mode="json"), "model": self.model_json(files)}, status_code=202)

    async def stop_route(self, request: Request) -> Response:
        files, refused = await self._target(request)
        if files is None:
            return refused or _error(400, "no model named", "see GET /api/models")
        job = self.warmer.stop(files.key)
        if job is None or (job.state not in ("queued", "running") and not job.stop_flag.is_set()):
            return _error(409, f"no warm of {files.key} is in progress", "POST /api/models/warm starts one", key=files.key)
        await self.warmer.wait(files.key)
        return JSONResponse({"warm": Warm.of(job).model_dump(mode="json")})

    async def loads_route(self, request: Request) -> Response:
        return JSONResponse({"loads": [MeasuredLoad.of(r).model_dump(mode="json") for r in self.loads.records],
                             "thresholds": LoadSplit.of(self.loads.thresholds()).model_dump(mode="json")})

    # -- health ---------------------------------------------------------------------------------
    async def health_entries(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        from proxy.admin.health_entry import HealthEntry
        try:
            everything = await self.files(self.catalog.all_files)
        except (FileWorkBusy, TimeoutError) as exc:
            return [HealthEntry("model files", "unknown", f"the model folders could not be read in time ({exc or 'timed out'})",
                                "residency and warming wait for them; traffic does not", BUSY_FIX)]
        out = []
        for name, found in everything.items():
            problems = found.located.problems
            skipped = found.located.skipped
            if skipped:
                shown = "; ".join(f"{k.path}: {k.reason}" for k in skipped[:SKIPPED_SHOWN])
                more = f" (and {len(skipped) - SKIPPED_SHOWN} more)" if len(skipped) > SKIPPED_SHOWN else ""
                out.append(HealthEntry(f"model files {name} skipped", "degraded",
                                       f"{len(skipped)} skipped: {shown}{more}",
                                       "they are not listed, measured or warmed (only regular files inside the model "
                                       "folders are)",
                                       "remove them, or for a link to another folder, add that folder to "
                                       f"tenants.{name}.model_paths"))
            if found.unknown_reason:
                out.append(HealthEntry(f"model files {name}", "unknown", found.unknown_reason,
                                       "residency, warming and warm-during-release are off for it",
                                       f"set tenants.{name}.model_paths to its model folders' parent directory"))
            elif problems:
                out.append(HealthEntry(f"model files {name}", "degraded", "; ".join(p.problem for p in problems),
                                       "its models' residency is unknown and they are not warmed before a load",
                                       problems[0].fix))
            else:
                out.append(HealthEntry(f"model files {name}", "ok", files_summary(found.located)))
        verdict = self.loads.verdict()
        if verdict.dominates:
            speeds = (f" at a median {verdict.cold_gbps:.2f} GB/s from disk vs {verdict.warm_gbps:.2f} GB/s from RAM"
                      if verdict.cold_gbps and verdict.warm_gbps else "")
            out.append(HealthEntry("model load speed", "degraded",
                                   f"{verdict.cold} of the last {verdict.classified} model loads read from disk{speeds}",
                                   "each handoff waits for a disk read of the next model",
                                   "keep the models you alternate between in RAM (proxy.keep_warm_models), "
                                   "or add host RAM; warm-during-release (proxy.warm_during_release) hides part of it"))
        return out


def _busy(exc: BaseException) -> JSONResponse:
    response = _error(503, f"the model files could not be read in time ({exc or 'timed out'})", BUSY_FIX)
    response.headers["retry-after"] = "5"
    return response


def _names(model: str) -> set[str]:
    return {model, f"{model}:latest"} if ":" not in model.rsplit("/", 1)[-1] else {model}


def models_extension(proxy: ProxyView) -> ModelsExtension:
    return ModelsExtension(proxy)


