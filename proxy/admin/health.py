"""Self-check: `GET /api/health`, `GET /api/engines` (admin listener) and `hyperswap check`.

Health is one entry per dependency, each saying what is wrong, what that breaks for the user, and
the command or setting that fixes it. Checks run concurrently with a timeout each; a check that
raises is reported as failed with its exception text and never takes the endpoint down.

The unmanaged-VRAM entry states what unmanaged processes cost: which installed Ollama models would
fit the card without them but do not with them. ComfyUI's floor comes from a small in-memory ring
of per-tenant VRAM samples (taken at each health call and on a timer from the last snapshot).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import httpx
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from websockets.asyncio.client import connect as ws_connect

from proxy.admin.address import admin_base_url
from proxy.admin.health_entry import HealthEntry, lifecycle_entries, worst
from proxy.admin.health_report import HealthEntry as entry_model
from proxy.admin.health_report import HealthReport, format_report
from proxy.admin.proxy_view import ProxyView
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.engines.loading import load_registry
from proxy.engines.ports import HealthPorts
from proxy.engines.settings import EnvReaders
from proxy.errors import ConfigError, HyperSwapError
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
from proxy.gpu.nvml import CONTAINER_NOTE, NvmlReader
from proxy.gpu.visibility import capabilities, summary
from proxy.handoff.per_card import candidates, shares
from proxy.tasks import cancel_and_wait
from proxy.tls import client_context

CHECK_TIMEOUT_S = 3.0
SAMPLE_INTERVAL_S = 10.0
SAMPLES_KEPT = 360  # an hour at the default interval
FLOOR_WINDOW_S = 3600.0
STALE_FIX = 'POST /queue {"clear":true} or restart ComfyUI'


@runtime_checkable
class TelemetryReadings(Protocol):
    """What health reads from the telemetry extension: its own health, and recent VRAM minima."""

    def healthy(self) -> tuple[bool, str]: ...

    def min_vram(self, tenant: str, window_s: float) -> int | None: ...


@runtime_checkable
class GpuHealth(Protocol):
    """What health reads from the GPU settings extension: its entries against gpu_profile."""

    async def gpu_health(self) -> list[HealthEntry]: ...


Check = Callable[[AttributedSnapshot], Awaitable["HealthEntry | list[HealthEntry]"]]


@dataclass(frozen=True, slots=True)
class NamedCheck:
    name: str
    run: Check


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _who(processes: Sequence[AttributedProcess]) -> str:
    return ", ".join(f"{_short_cmd(p.process.cmdline, p.process.name)} (pid {p.process.pid}, "
                     f"{_gib(p.process.used_bytes) if p.process.used_bytes is not None else 'unknown amount'})"
                     for p in processes)


def _held(room: Sequence[_Room]) -> int:
    return sum(r.held for r in room)


def _where(room: Sequence[_Room]) -> str:
    """Who holds memory, card by card: `python relay.py (pid 7, 8.00 GiB) on GPU 0` (no card named with one)."""
    return "; ".join(_who(r.unmanaged) + (f" on {r.where}" if r.where else "") for r in room if r.unmanaged)


def _fix(processes: Sequence[AttributedProcess]) -> str:
    return ("stop or move " + ", ".join(f"pid {p.process.pid}" for p in processes)
            + ", or add a tenant for it in tenants.json (match + release) so the proxy can ask it for memory")


@dataclass(frozen=True, slots=True)
class _Room:
    """One card as a tenant's loads see it (HealthExtension._room_on)."""

    where: str  # "GPU 1" on a host with several cards, else ""
    unmanaged: tuple[AttributedProcess, ...]
    held: int  # known bytes the unmanaged processes hold there
    without: int  # room for the tenant were they gone
    actual: int  # room with them


def _short_cmd(cmdline: str, name: str) -> str:
    """`python stt_relay.py --model x` -> `python stt_relay.py`: enough to recognise it."""
    words = cmdline.split()
    if not words:
        return name
    out = [words[0].rsplit("/", 1)[-1]]
    if len(words) > 1 and not words[1].startswith("-"):
        out.append(words[1].rsplit("/", 1)[-1])
    return " ".join(out)


class HealthExtension:
    name = "health"  # others add checks to it (model files): `ProxyView.extension("health")`
    def __init__(self, proxy: ProxyView, *, timeout_s: float = CHECK_TIMEOUT_S, sample_interval_s: float = SAMPLE_INTERVAL_S,
                 env: EnvReaders | None = None) -> None:
        self.proxy = proxy
        self.timeout_s = timeout_s
        self.sample_interval_s = sample_interval_s
        self.env = env or EnvReaders()
        self.samples: dict[str, deque[tuple[float, int]]] = {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self.checks: list[NamedCheck] = [
            NamedCheck("nvml", self.check_nvml),
            NamedCheck("upstreams", self.check_upstreams),
            NamedCheck("comfyui websocket", self.check_comfy_ws),
            NamedCheck("configuration", self.check_config),
            NamedCheck("telemetry", self.check_telemetry),
            NamedCheck("stale queue entries", self.check_stale),
            NamedCheck("unmanaged VRAM", self.check_unmanaged),
            NamedCheck("gpu profile", self.check_gpu_profile),
            NamedCheck("gpu devices", self.check_devices),
            NamedCheck("lifecycle", self.check_lifecycles),
        ]

    # -- extension interface ---------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [Route("/api/health", self.health_route, methods=["GET"]),
                Route("/api/engines", self.engines_route, methods=["GET"])]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sampler(), name="hyperswap:health-sampler")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=min(2.0, self.timeout_s)),
                                             trust_env=False, verify=client_context())
        return self._client

    # -- VRAM samples ----------------------------------------------------------------------------
    def sample(self, snap: AttributedSnapshot) -> None:
        if snap.estimated:
            return  # engine self-reports are not floors
        now = self.proxy.clock.now()
        for tenant in self.proxy.registry:
            ring = self.samples.setdefault(tenant.name, deque(maxlen=SAMPLES_KEPT))
            ring.append((now, snap.held_by(tenant.name)))

    def floor(self, tenant: str) -> int | None:
        ring = self.samples.get(tenant)
        return min(b for _, b in ring) if ring else None

    async def _sampler(self) -> None:
        while True:
            await self.proxy.clock.sleep(self.sample_interval_s)
            snap = self.proxy.broker.last_snapshot
            try:
                if snap is None:
                    snap = await self.proxy.broker.snapshot()
                self.sample(snap)
            except asyncio.CancelledError:
                raise
            except Exception:  # a sample is best effort; the next health call samples again
                pass

    # -- running the checks ----------------------------------------------------------------------
    async def _run_one(self, check: NamedCheck, snap: AttributedSnapshot) -> list[HealthEntry]:
        try:
            result = await asyncio.wait_for(check.run(snap), self.timeout_s)
        except TimeoutError:
            return [HealthEntry(check.name, "failed", f"the check did not finish within {self.timeout_s:g} s",
                                "this dependency's state is unknown",
                                "run `hyperswap check` again; if it repeats, the dependency hangs")]
        except Exception as exc:
            return [HealthEntry(check.name, "failed", f"the check raised {type(exc).__name__}: {exc}",
                                "this dependency's state is unknown", "see the proxy's log; report it if it repeats")]
        return result if isinstance(result, list) else [result]

    async def report(self) -> HealthReport:
        broker = self.proxy.broker
        snap: AttributedSnapshot | None
        try:
            snap = await asyncio.wait_for(broker.snapshot(), self.timeout_s)
        except (TimeoutError, Exception):
            snap = broker.last_snapshot
        if snap is None:
            return HealthReport(status="failed", entries=[entry_model.of(HealthEntry(
                "nvml", "failed", "no GPU snapshot could be taken", "arbitration has nothing to plan with",
                "run `nvidia-smi`; see the proxy's log"))])
        self.sample(snap)
        results = await asyncio.gather(*(self._run_one(c, snap) for c in self.checks))
        entries = [e for group in results for e in group]
        caps = capabilities(snap, broker.last_read_error)
        return HealthReport(status=worst([e.status for e in entries]), entries=[entry_model.of(e) for e in entries],
                            capabilities=caps, checked_at=time.time())

    async def health_route(self, request: Request) -> Response:
        return JSONResponse((await self.report()).dump())

    # -- the checks ------------------------------------------------------------------------------
    async def check_nvml(self, snap: AttributedSnapshot) -> HealthEntry:
        err = self.proxy.broker.last_read_error
        if err is not None:
            return HealthEntry("nvml", "failed", f"{err.state}: {err.message}",
                               "the proxy cannot see which process holds GPU memory; "
                               + summary(capabilities(snap, err)), err.fix)
        raw = snap.snapshot
        if raw.source == "simulated":
            return HealthEntry("nvml", "ok", f"simulated GPU ({raw.device.name}, {_gib(raw.device.total_bytes)})")
        if CONTAINER_NOTE in raw.notes:
            return HealthEntry("nvml", "degraded", CONTAINER_NOTE,
                               "GPU memory cannot be attributed to tenants: every process looks unmanaged, so plans "
                               "cannot release the right tenant",
                               "run the proxy with --pid=host (Docker) or hostPID: true (Kubernetes)")
        unknown = [p for p in raw.processes if p.used_bytes is None]
        if unknown:
            return HealthEntry("nvml", "degraded",
                               f"the driver does not report per-process memory for {len(unknown)} process(es) "
                               f"({', '.join(f'{p.name} pid {p.pid}' for p in unknown[:5])}) (WSL or MIG?)",
                               "what those processes hold is unknown, so plans may under-count what a release frees",
                               "run on native Linux without MIG for per-process figures; set idle_vram_gb/needs_vram_gb by hand")
        note = "; ".join(raw.notes)
        return HealthEntry("nvml", "ok", f"{raw.device.name}: {len(raw.processes)} GPU process(es) visible"
                           + (f" ({note})" if note else ""))

    def adapter(self, tenant: Tenant) -> HealthPorts:
        return self.proxy.engines(tenant)

    def _fix_upstream(self, tenant: Tenant) -> str:
        where = self.proxy.config_path or self.proxy.registry.source
        start = self.adapter(tenant).start_hint or f"start {tenant.name}"
        return f"{start}, or correct tenants.{tenant.name}.upstream ({tenant.upstream}) in {where or 'tenants.json'}"

    async def _check_upstream(self, tenant: Tenant) -> HealthEntry:
        name = f"upstream {tenant.name}"
        if not tenant.upstream:
            return HealthEntry(name, "ok", "no upstream (VRAM-only tenant)")
        machine = self.proxy.broker.lifecycles.machine(tenant.name)
        if machine is not None and machine.state != "running":  # not up on purpose: its lifecycle entry says more
            return HealthEntry(name, "ok", f"{machine.state}: a tenant the proxy starts and stops (its next request "
                                           f"starts it; see lifecycle {tenant.name})")
        impact = (f"requests to {tenant.listen or 'its listener'} answer 502, and the proxy cannot ask {tenant.name} "
                  "for memory back")
        adapter = self.adapter(tenant)
        path = adapter.probe_path
        try:
            r = await self.client.get(tenant.upstream + path)
        except httpx.HTTPError as exc:
            return HealthEntry(name, "failed", f"cannot reach {tenant.upstream}: {type(exc).__name__}: {exc}".rstrip(": "),
                               impact, self._fix_upstream(tenant))
        if not adapter.probe_strict:  # an app of its own: any answer below 500 is alive
            if r.status_code >= 500:
                return HealthEntry(name, "degraded", f"GET {tenant.upstream}/ answered {r.status_code}", impact,
                                   f"check {tenant.name}'s own log")
            return HealthEntry(name, "ok", f"reachable at {tenant.upstream} (GET / answered {r.status_code})")
        if r.status_code != 200:
            return HealthEntry(name, "degraded", f"GET {tenant.upstream}{path} answered {r.status_code}",
                               f"{tenant.name} answers but not as a {tenant.engine} server: releases and need estimates may fail",
                               f"check that tenants.{tenant.name}.upstream points at {tenant.engine}")
        try:
            data = r.json()
        except ValueError:
            data = None
        version = adapter.version_from_probe(data)
        return HealthEntry(name, "ok", f"reachable at {tenant.upstream}, {tenant.engine} version {version or 'unknown'}")

    async def check_upstreams(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        tenants = list(self.proxy.registry)
        results = await asyncio.gather(*(self._check_upstream(t) for t in tenants), return_exceptions=True)
        return [r if isinstance(r, HealthEntry) else
                HealthEntry(f"upstream {t.name}", "failed", f"the check raised {type(r).__name__}: {r}",
                            "this upstream's state is unknown", "see the proxy's log")
                for t, r in zip(tenants, results, strict=True)]

    async def _check_ws(self, tenant: Tenant) -> HealthEntry:
        name = f"comfyui websocket {tenant.name}"
        adapter = self.adapter(tenant)
        url = adapter.status_websocket(f"hyperswap-health-{uuid.uuid4().hex[:8]}")
        assert url is not None  # check_comfy_ws picks tenants that have one
        impact = ("ComfyUI jobs cannot be followed: the UI shows no progress, and the proxy cannot see when a "
                  "prompt finishes (busy state falls back to polling)")
        try:
            async with ws_connect(url, open_timeout=self.timeout_s, ping_interval=None, close_timeout=1.0) as ws:
                raw = await ws.recv()
        except Exception as exc:
            return HealthEntry(name, "failed", f"cannot open {url.split('?')[0]}: {type(exc).__name__}: {exc}", impact,
                               self._fix_upstream(tenant))
        if not adapter.is_status_frame(raw):
            return HealthEntry(name, "degraded", f"the first websocket frame was not a status frame with a sid: {str(raw)[:120]}",
                               impact, f"check that tenants.{tenant.name}.upstream points at ComfyUI")
        return HealthEntry(name, "ok", f"status frame with sid from {url.split('?')[0]}")

    async def check_comfy_ws(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        tenants = [t for t in self.proxy.registry if self.adapter(t).status_websocket("") is not None]
        return list(await asyncio.gather(*(self._check_ws(t) for t in tenants)))

    async def check_config(self, snap: AttributedSnapshot) -> HealthEntry:
        path = self.proxy.config_path or self.proxy.registry.source
        # the demo: its scenario, and the file applied over it (a config_path set since names its own file)
        note = self.proxy.config_note if self.proxy.config_path is None else None
        if path is None:
            return HealthEntry("configuration", "ok", note or "shipped defaults (no tenants.json in use)")
        try:
            await asyncio.to_thread(load_registry, path)
        except ConfigError as exc:
            problems = "; ".join(exc.problems)
            return HealthEntry("configuration", "failed", f"{exc.message}" + (f": {problems}" if problems else ""),
                               "the running proxy keeps the configuration it started with, but the next start fails",
                               exc.fix or f"fix {path}")
        return HealthEntry("configuration", "ok", f"{note}; the file is valid" if note else f"{path}: valid")

    async def check_lifecycles(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        """Each tenant the proxy starts and stops: a failed start with its error and fix, and what its
        controller finds wrong without changing anything (an orphan of an earlier run, named and never
        killed; an unknown unit; a missing container; an unreachable Docker socket)."""
        machines = self.proxy.broker.lifecycles.machines()
        found = await asyncio.gather(*(m.controller.check() for m in machines.values()), return_exceptions=True)
        entries: list[HealthEntry] = []
        for (name, machine), problems in zip(machines.items(), found, strict=True):
            entries += lifecycle_entries(name, machine, problems)
        for name, rec in self.proxy.broker.lifecycles.suspensions.records().items():  # release kind cuda_suspend
            parked = f": {rec.parked_bytes / 2**30:.1f} GiB parked in host RAM ({rec.via})" if rec.parked_bytes else ""
            entries.append(HealthEntry(f"suspend {name}", "degraded" if rec.error else "ok", rec.error or f"{rec.state}{parked}",
                                       "its memory was not parked, or not restored: the next release step ran"
                                       if rec.error else None, rec.fix))
        return entries

    def telemetry(self) -> TelemetryReadings | None:
        """The telemetry extension (it calls itself "telemetry"), looked up by name without importing
        it; None when none runs."""
        ext = self.proxy.extension("telemetry")
        return ext if isinstance(ext, TelemetryReadings) else None

    async def check_telemetry(self, snap: AttributedSnapshot) -> HealthEntry:
        store = self.telemetry()
        if store is None:
            return HealthEntry("telemetry", "degraded", "not configured: history is kept in memory only",
                               "history, charts and VRAM floors are lost on restart", "enable the telemetry store")
        ok, text = store.healthy()
        if ok:
            return HealthEntry("telemetry", "ok", str(text))
        return HealthEntry("telemetry", "degraded", str(text), "history and charts miss what happens now",
                           "check HYPERSWAP_TELEMETRY points at a writable file with free disk space, then restart")

    def comfy_floor(self, tenant: str) -> int | None:
        """Smallest VRAM seen recently: the telemetry's samples when there are any, else this ring's."""
        store = self.telemetry()
        if store is not None:
            try:
                value = store.min_vram(tenant, FLOOR_WINDOW_S)
            except Exception:
                value = None
            ring = self.floor(tenant)
            if isinstance(value, int):
                return value if ring is None else min(value, ring)
        return self.floor(tenant)

    async def check_stale(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        """Jobs counted as running that the evidence says are not (proxy/handoff/busy.py). Clearing
        the engine's queue is advised only on positive evidence that an entry is dead: listed while its
        tenant holds only its idle floor on a card that shows its memory."""
        states = self.proxy.broker.scheduler.states(snap)  # from the queues the watchdog read
        stale = {name: s for name, s in states.items() if s.stale_jobs}
        if not stale:
            return [HealthEntry("stale queue entries", "ok", "none")]
        out = []
        for tenant, state in stale.items():
            ids = ", ".join(state.stale_jobs)
            upstream = self.proxy.registry.get(tenant).upstream if tenant in self.proxy.registry else None
            at = f" (at {upstream})" if upstream else ""
            if state.stale_why == "vram":
                out.append(HealthEntry(
                    f"stale queue entries {tenant}", "degraded",
                    f"{tenant} lists {len(state.stale_jobs)} job(s) as running but holds only its idle VRAM: "
                    f"prompt id(s) {ids}",
                    "clients polling the queue wait on a job that never finishes; the proxy does not count it as busy",
                    STALE_FIX + at))
            elif state.stale_why == "unreachable":
                out.append(HealthEntry(
                    f"stale queue entries {tenant}", "degraded",
                    f"{tenant}'s queue has not answered for proxy.job_lost_after_s: job(s) {ids} no longer counted",
                    "their clients get no result from this run of the engine",
                    f"check that {tenant} runs and answers{at} (`hyperswap check`); send the jobs again once it does"))
            else:
                out.append(HealthEntry(
                    f"stale queue entries {tenant}", "ok",
                    f"{tenant}'s own queue no longer lists job(s) {ids}: they end once its history shows them",
                    "none: the proxy no longer counts them as running"))
        return out

    async def check_devices(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        """Several GPUs: which card each engine tenant loads on, and why (proxy/gpu/devices.py). None on one card."""
        if not snap.snapshot.several_devices:
            return []
        out = []
        for tenant in self.proxy.registry:
            placement = snap.placement.get(tenant.name)
            if not tenant.upstream or placement is None:
                continue
            if tenant.devices and placement.source == "any":
                out.append(HealthEntry(f"gpu devices {tenant.name}", "degraded", placement.detail,
                                       "its requests are planned on every card, not the one it really uses",
                                       f"name a card `nvidia-smi -L` lists in tenants.{tenant.name}.devices"))
            else:
                out.append(HealthEntry(f"gpu devices {tenant.name}", "ok", placement.detail))
        return out

    async def check_unmanaged(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        if snap.estimated:  # no process list: "no unmanaged processes" would be a claim nobody checked
            err = self.proxy.broker.last_read_error
            return [HealthEntry("unmanaged VRAM", "unknown",
                                "cannot be checked: without a GPU reader no process outside the tenants' engines is visible",
                                "memory other programs hold is not counted: a load may still run out of memory",
                                err.fix if err else "fix the GPU reader (see the nvml entry)")]
        unmanaged = snap.unmanaged()
        held = sum(p.process.used_bytes or 0 for p in unmanaged)
        if not unmanaged:
            return [HealthEntry("unmanaged VRAM", "ok", "no unmanaged GPU processes")]
        who = _who(unmanaged)
        fix = _fix(unmanaged)
        out: list[HealthEntry] = []
        for tenant in self.proxy.registry:
            adapter = self.adapter(tenant)
            if not adapter.sized_catalog or not tenant.upstream:
                continue
            room = [r for r in (self._room_on(snap, tenant, i) for i in candidates(snap, tenant.name)) if r is not None]
            if not room:
                return [HealthEntry("unmanaged VRAM", "degraded", f"unmanaged processes hold {_gib(held)}: {who}",
                                    "the card's size is unknown, so the cost cannot be stated", fix)]
            out.append(await self._unmanaged_cost(tenant, adapter, room))
        return out or [HealthEntry("unmanaged VRAM", "ok", f"unmanaged processes hold {_gib(held)}: {who}")]

    async def _unmanaged_cost(self, tenant: Tenant, adapter: HealthPorts, room: list[_Room]) -> HealthEntry:
        """What the unmanaged processes cost one tenant: which of its installed models they keep off
        the card (degraded), or none (ok)."""
        name = f"unmanaged VRAM ({tenant.name})"
        if not any(r.unmanaged for r in room):
            cards = ", ".join(r.where for r in room)
            return HealthEntry(name, "ok", f"no unmanaged GPU processes on {cards}" if cards else "no unmanaged GPU processes")
        # a load goes to whichever of the tenant's cards has room: the best card with the unmanaged
        # processes (actual) against the best card were they gone (widest)
        actual, widest = max(r.actual for r in room), max(r.without for r in room)
        try:
            needs = await adapter.installed_needs(self.client)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return HealthEntry(name, "degraded",
                               f"unmanaged processes hold {_gib(_held(room))}: {_where(room)}; {tenant.name}'s "
                               f"models could not be read ({type(exc).__name__})",
                               f"{tenant.name} can use at most {_gib(actual)} instead of {_gib(widest)}",
                               _fix([p for r in room for p in r.unmanaged]))
        hurt = [(n, b) for n, b in needs if actual < b <= widest]  # too large for every card: nobody's fault
        return _models_kept_off(name, tenant, room, hurt, actual, widest)

    def _room_on(self, snap: AttributedSnapshot, tenant: Tenant, index: int) -> _Room | None:
        """What one card leaves a tenant's loads: its usable memory less the pinned tenants and the
        other reclaimable tenants' floors there (`without`), then less the unmanaged processes on it
        (`actual`). None: the card's size is unknown. With one card, the whole snapshot."""
        card = snap.on_device(index)
        dev = card.snapshot.device
        if dev.total_bytes <= 0:
            return None
        unmanaged = card.unmanaged()
        held = sum(p.process.used_bytes or 0 for p in unmanaged)
        pinned = sum(card.held_by(t.name) for t in self.proxy.registry if not t.reclaimable)
        floors = 0
        for other in self.proxy.registry:
            if other.name == tenant.name or not other.reclaimable or not shares(snap, other.name, index):
                continue
            floor = self.comfy_floor(other.name) if self.adapter(other).floor_from_samples else None
            floors += floor if floor is not None else min(other.idle_vram_bytes, card.held_by(other.name))
        without = dev.total_bytes - dev.reserved_bytes - pinned - floors
        where = f"GPU {index}" if snap.snapshot.several_devices else ""
        return _Room(where, unmanaged, held, without, without - held)

    async def check_gpu_profile(self, snap: AttributedSnapshot) -> list[HealthEntry]:
        """The card's settings against gpu_profile, from the extension that keeps them (proxy.admin.gpu_api)."""
        ext = self.proxy.extension("gpu")  # explicit lookup by name, without importing it
        return list(await ext.gpu_health()) if isinstance(ext, GpuHealth) else []

    # -- /api/engines ------------------------------------------------------------------------------
    def _host_reads(self) -> bool:
        if self.env.host is not None:
            return self.env.host
        reader = getattr(self.proxy.reader, "inner", self.proxy.reader)  # under proxy.gpu.pods.PodAwareReader
        return isinstance(reader, NvmlReader)  # a simulated GPU's engines are not the host's

    async def engine_view(self, tenant: Tenant, snap: AttributedSnapshot | None) -> dict[str, object] | None:
        """What the tenant's engine reports about itself; None for an engine that reports nothing."""
        report = await self.adapter(tenant).settings_view(self.client, snap, self.env, self._host_reads())
        return None if report is None else report.model_dump(mode="json")

    async def engines_route(self, request: Request) -> Response:
        broker = self.proxy.broker
        try:
            snap: AttributedSnapshot | None = await asyncio.wait_for(broker.snapshot(), self.timeout_s)
        except Exception:
            snap = broker.last_snapshot
        tenants = list(self.proxy.registry)
        views = await asyncio.gather(*(self.engine_view(t, snap) for t in tenants), return_exceptions=True)
        out = [v if isinstance(v, dict) else {"tenant": t.name, "engine": t.engine, "error": f"{type(v).__name__}: {v}"}
               for t, v in zip(tenants, views, strict=True) if v is not None]
        return JSONResponse({"engines": out})


def health_extension(proxy: ProxyView) -> HealthExtension:
    return HealthExtension(proxy)


# -- the CLI ---------------------------------------------------------------------------------------

def check_main(config: str | None, admin_url: str | None, as_json: bool) -> int:
    """`hyperswap check`: the running proxy's /api/health. 1 on any failure, 2 when no proxy answers."""
    try:
        base = admin_base_url(config, admin_url)
    except HyperSwapError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    url = base + "/api/health"
    try:
        with httpx.Client(timeout=httpx.Timeout(30.0, connect=3.0), trust_env=False, verify=client_context()) as client:
            r = client.get(url)
    except httpx.HTTPError as exc:
        print(f"error: no HyperSwap proxy answers at {base} ({type(exc).__name__}) "
              "(fix: start it with `hyperswap serve`, or pass --admin URL / --config PATH)", file=sys.stderr)
        return 2
    try:
        body = r.json()
    except ValueError:
        body = None
    try:
        report = HealthReport.model_validate(body) if r.status_code == 200 else None
    except ValidationError:
        report = None
    if report is None:
        print(f"error: {url} answered {r.status_code} without a health report (is that a HyperSwap admin listener?)",
              file=sys.stderr)
        return 2
    print(json.dumps(body, indent=2) if as_json else format_report(report))
    return 1 if any(e.status == "failed" for e in report.entries) else 0


def _models_kept_off(name: str, tenant: Tenant, room: list[_Room], hurt: list[tuple[str, int]], actual: int,
                     widest: int) -> HealthEntry:
    """The entry for the installed models that fit were the unmanaged processes gone, but not now."""
    if not hurt:
        unknown = sum(1 for r in room for p in r.unmanaged if p.process.used_bytes is None)
        return HealthEntry(
            name, "ok",
            f"unmanaged processes hold {_gib(_held(room))} ({_where(room)}); every installed {tenant.name} model "
            f"that fits {_gib(widest)} still fits the {_gib(actual)} left"
            + (f" ({unknown} process(es) of unknown size not counted)" if unknown else ""))
    names = ", ".join(f"{n} ({_gib(b)})" for n, b in hurt)
    blocking = [r for r in room if r.unmanaged and r.without >= min(b for _, b in hurt)]
    return HealthEntry(
        name, "degraded",
        f"{len(hurt)} model(s) fit within {_gib(widest)} but not the {_gib(actual)} actually available: "
        f"held by {_where(blocking)}",
        f"{tenant.name} cannot load {names} fully on the GPU: loads answer 507 naming these processes",
        _fix([p for r in blocking for p in r.unmanaged]))
