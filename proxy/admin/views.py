"""The admin side's payloads as typed views, built once: the tenant view, the device, GPU errors,
decisions and their outcomes. The admin API, the events stream, MCP, metrics, telemetry and the
OpenAPI document all use these models, so what is served, what is parsed and what is documented
cannot drift apart (a test validates live answers against /openapi.json).

Models keep unknown keys (`extra="allow"`): a payload that grows a field stays valid, and the
document says what is promised. Answers are dumped with `exclude_unset`, so a field nobody set
is left out rather than invented (unknown is absent or null, never a made-up default).
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, Field

from proxy.config.schema import Tenant
from proxy.encoding import JSONModel, JSONObject
from proxy.engines.ports import TenantCatalog
from proxy.errors import ErrorBody
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
from proxy.gpu.snapshot import GpuError, GpuReadError, PodName
from proxy.gpu.visibility import Device, TenantDevices, tenant_vram
from proxy.handoff.broker import GpuBroker
from proxy.handoff.decision_json import Decision, RequestStory
from proxy.handoff.plan import TenantState, gib
from proxy.handoff.plan_json import Plan
from proxy.handoff.release_result import ReleaseOutcome
from proxy.handoff.watchdog import Watchdog
from proxy.lifecycle.controller import LifecycleController
from proxy.lifecycle.report_json import LifecycleReport, Suspended
from proxy.relay.refusals import NotEnoughMemory

_Doc = JSONModel


class Error(ErrorBody):
    """Every error answer: a sentence, and a hint where one helps. Extra keys give details."""
    tenant: str | None = None
    reason: str | None = Field(default=None, description="machine-readable, e.g. busy, not_reclaimable")


class DryRun(_Doc):
    dry_run: Literal[True]
    plan: Plan


class Rejection(NotEnoughMemory):
    """The 507 a tenant's listener answers when no plan frees enough memory."""


class ReleaseResult(ReleaseOutcome):
    """`POST /api/tenants/{name}/release`: the release as a decision's outcome lists it, and on a failure
    what to do about it."""
    fix: str | None = Field(default=None, description="on 502 and 504: what to do about it")
    reason: Literal["cpu"] | None = Field(default=None, description="cpu: the engine runs on the CPU and holds no GPU "
                                                                    "memory; nothing was asked")
    note: str | None = None


class Process(_Doc):
    pid: int
    name: str
    cmdline: str | None = None
    tenant: str | None = None
    vram_bytes: int | None
    vram_gb: float | None = None
    pod: PodName | None = Field(default=None, description="the Kubernetes pod it runs in; null off Kubernetes or unknown")


class Waiting(_Doc):
    """A request waiting in the handoff queue for GPU memory."""
    id: int
    tenant: str
    trigger: str
    since: float = Field(description="unix seconds")
    waited_s: float
    need_bytes: int
    need_gb: float | None
    priority: int
    waiting_for: list[str] = Field(description="busy tenants it waits for")
    behind: int | None = Field(description="the waiting request it queues behind, if any")
    reason: str
    position: int | None = Field(default=None, description="its place in line, 1 first: by priority, then arrival "
                                 "(an aged waiter, or one whose load is on the card already, may go sooner)")


class LoadUnderway(_Doc):
    """A model load on its way to the card: forwarded to the engine, which has not answered yet."""
    model: str
    since: float = Field(description="unix seconds, when it was forwarded")
    elapsed_s: float
    need_bytes: int = Field(description="what the proxy planned for it (its estimate)")
    need_gb: float | None
    on_card_bytes: int | None = Field(description="what the tenant gained on the card since it began, at most the need")
    on_card_gb: float | None
    estimated: bool = Field(description="on_card is an estimate: the tenant held other memory when it began (the card "
                                        "shows a process's memory, not a model's), or no GPU reader measured it")


class Lifecycle(_Doc):
    """A tenant the proxy starts and stops (release kind process, systemd or docker): its state now."""
    state: Literal["running", "stopped", "starting", "stopping", "failed", "exited"]
    for_s: float = Field(description="seconds in this state")
    error: str | None = Field(description="why the last start (or stop) failed")
    fix: str | None
    output: list[str] = Field(description="a failed start: the app's last output lines")
    failures: int = Field(description="consecutive failed starts")
    crashes: int = Field(default=0, description="consecutive ends while running (a crash, an exit, no answer to its "
                                                "probe); an app that ran a minute starts the count over")
    exit_code: int | None = Field(default=None, description="how it ended on its own (negative: the signal that "
                                                            "killed it); null: it did not, or the code is not known")
    restart: Literal["never", "on-failure"] = Field(default="never", description="its restart policy (tenants.json)")
    restart_status: str | None = Field(default=None, description="restart on-failure: what it does next (\"try 2 of 3 "
                                                                 "in 2.0 s\") or that it gave up; null: nothing to say")
    preload: bool = Field(default=False, description="started once the proxy is up (tenants.json)")
    preload_error: str | None = Field(default=None, description="why that start failed; null: it worked, or none")
    retry_in_s: float | None = Field(description="after a failed start: seconds until a request may start it again "
                                                 "(the admin's start does not wait)")
    controller: LifecycleController


class _TenantLive(_Doc):
    """The live state both /api/tenants and the events' stats frames carry."""
    name: str
    vram_bytes: int | None = Field(description="null when nobody could see it (no GPU reader and no report of its own)")
    vram_gb: float | None
    busy: bool
    busy_reason: str
    in_flight: int
    jobs: list[str]
    stale_jobs: list[str]
    last_activity_age_s: float | None
    idle_release_in_s: float | None = Field(description="seconds until the idle release; null: never")
    reclaimable: bool
    waiting: list[Waiting] = Field(default_factory=list, description="this tenant's requests waiting for memory")
    loading: LoadUnderway | None = Field(default=None, description="the (oldest) model load on its way to the card")
    devices: TenantDevices | None = Field(default=None, description="only on a host with several GPUs")
    lifecycle: Lifecycle | None = Field(default=None, description="a tenant the proxy starts and stops: its state; "
                                                                  "null for the others")
    suspension: Suspended | None = Field(default=None, description="a tenant with a cuda_suspend step: its state; null "
                                                                   "for the others")


class TenantView(_TenantLive):
    config: dict[str, object]
    processes: list[Process]
    watchdog: str | None
    estimated: bool
    listening: str | None = Field(default=None, description="the URL the tenant's listener answers at; null: no listener")


class TenantList(_Doc):
    tenants: list[TenantView]


# -- decisions: their shapes are proxy/handoff/decision_json.py's --------------------------------------------

class DecisionList(_Doc):
    decisions: list[Decision]


class DecisionDetail(_Doc):
    """`GET /api/decisions/{id}`: one decision, and the story of the request it belongs to."""
    decision: Decision
    story: RequestStory | None = Field(description="null: not a GPU request's that waited or caused a handoff")
    related: list[Decision] = Field(description="the story's other decisions, as GET /api/decisions shows them")


class Stats(_Doc):
    device: Device
    processes: list[Process]
    tenants: list[TenantView]
    decisions: list[Decision]
    gpu_error: GpuError | None


class StatsTenant(_TenantLive):
    engine: str
    priority: int
    pids: list[int]


class StatsFrame(_Doc):
    """`data:` of an `event: stats` frame on /api/events (one a second)."""
    device: Device
    tenants: list[StatsTenant]
    processes: list[Process]
    in_flight: int
    busy: list[str]
    decision_ids: list[int]
    handoff_in_progress: bool
    queue: list[Waiting] = Field(default_factory=list, description="every request waiting for memory, in arrival order")
    gpu_error: GpuError | None


class LifecycleFrame(_Doc):
    """`data:` of an `event: lifecycle` frame: a tenant the proxy starts and stops changed state."""
    tenant: str
    lifecycle: Lifecycle
    report: LifecycleReport | None = Field(description="the start or stop that just ended; null: a change seen "
                                                       "on its way (starting, stopping)")


class LifecycleAnswer(_Doc):
    """`POST /api/tenants/{name}/start` and `/stop`: what was done and the tenant's state after it."""
    tenant: str
    action: Literal["start", "stop"]
    ok: Literal[True]
    note: str | None = Field(default=None, description="nothing was done, and why (it already ran, or was stopped)")
    report: LifecycleReport | None = Field(default=None, description="start: how the start went")
    release: ReleaseResult | None = Field(default=None, description="stop: the release that stopped it, as "
                                                                    "/release answers it")
    lifecycle: Lifecycle


class LifecycleRefusal(_Doc):
    """A start or stop that was refused or failed: the reason, a fix, and the tenant's state."""
    error: str
    fix: str | None = Field(default=None, description="what to do about it")
    tenant: str | None = None
    reason: str | None = Field(default=None, description="not_lifecycle, busy, starting, start_failed, "
                                                         "queue_timeout, stop_failed")
    output: list[str] | None = Field(default=None, description="a failed start: the app's last output lines")
    retry_in_s: float | None = Field(default=None, description="a failed start: seconds before a request may "
                                                               "start it again")
    waited_s: float | None = Field(default=None, description="queue_timeout: how long the start waited for memory")
    waiting_for: list[str] | None = Field(default=None, description="queue_timeout: the busy tenants it waited for")
    release: ReleaseResult | None = Field(default=None, description="stop_failed: the release that tried")
    lifecycle: Lifecycle | None = Field(default=None, description="null for a tenant the proxy does not start")


class StopAllResult(_Doc):
    """One tenant's part in `POST /api/tenants/stop`: what its own `/stop` would have answered."""
    tenant: str
    ok: bool = Field(description="stopped now (by this call, or it was already)")
    status: int = Field(description="its own stop's status: 200, or 409 (busy, starting), 502 or 504 (the stop failed)")
    reason: str | None = Field(default=None, description="why it is not stopped: busy, starting, stop_failed")
    error: str | None = Field(default=None, description="why it is not stopped, in words")
    fix: str | None = None
    note: str | None = Field(default=None, description="nothing was done, and why (it was stopped already)")
    release: ReleaseResult | None = Field(default=None, description="the release that stopped it (or tried)")
    lifecycle: Lifecycle


class StopAllAnswer(_Doc):
    """`POST /api/tenants/stop`: every tenant the proxy starts, stopped if idle; the busy ones named."""
    ok: bool = Field(description="every tenant the proxy starts is stopped now")
    stopped: list[str] = Field(description="stopped now (by this call, or already)")
    refused: list[str] = Field(description="left running: busy or starting (their results say why)")
    failed: list[str] = Field(description="their stop failed (their results say why)")
    error: str | None = Field(default=None, description="which were not stopped and why; null when all were")
    fix: str | None = None
    results: list[StopAllResult] = Field(description="one per tenant the proxy starts, in tenants.json's order")


class LogLine(_Doc):
    """`data:` of an `event: line` frame of GET /api/tenants/{name}/logs: one line of the app's output."""
    line: str = Field(description="without its newline; cut to 1000 characters; a progress bar's last state")


class LogRun(_Doc):
    """`data:` of an `event: run` frame: the app was started again, and the lines after it are its new run's."""
    run: int = Field(description="the run's number since the proxy started (one per start)")
    note: str


class CatalogFrame(_Doc):
    """`data:` of an `event: catalog` frame: sent first, then only when it changes."""
    tenants: dict[str, TenantCatalog]


class ModelList(_Doc):
    tenants: list[dict[str, object]] = Field(description="per tenant: its model files with size and page-cache residency")


class EngineList(_Doc):
    engines: list[dict[str, object]] = Field(description="per tenant whose engine reports about itself: reachable, "
                                                         "version, settings")


# -- builders: each view is made here and nowhere else ----------------------------------------------

def dump(model: BaseModel) -> JSONObject:
    """A view as the JSON answer carries it."""
    return cast(JSONObject, model.model_dump(mode="json", exclude_unset=True, by_alias=True))


def device_view(snap: AttributedSnapshot) -> Device:
    """The device: unknown figures are null."""
    return Device.of(snap)  # several cards: the host's sums and each card


def gpu_error_view(err: GpuReadError | None) -> GpuError | None:
    return None if err is None else GpuError.of(err)


def tenant_process(p: AttributedProcess) -> Process:
    """A tenant's process, as its tenant view lists it."""
    return Process(pid=p.process.pid, name=p.process.name, cmdline=p.process.cmdline,
                   vram_bytes=p.process.used_bytes, vram_gb=gib(p.process.used_bytes), pod=_pod(p))


def card_process(p: AttributedProcess, *, cmdline: bool = True) -> Process:
    """A process on the card with its tenant (the stats frame leaves the command line out: it is large)."""
    if cmdline:
        return Process(pid=p.process.pid, name=p.process.name, cmdline=p.process.cmdline, tenant=p.tenant,
                       vram_bytes=p.process.used_bytes, pod=_pod(p))
    return Process(pid=p.process.pid, name=p.process.name, tenant=p.tenant, vram_bytes=p.process.used_bytes, pod=_pod(p))


def _pod(p: AttributedProcess) -> PodName | None:
    return PodName.of(p.pod) if p.pod else None


def lifecycle_view(broker: GpuBroker, tenant: str) -> Lifecycle | None:
    """A tenant the proxy starts and stops: its state now; None for the others."""
    machine = broker.lifecycles.machine(tenant)
    return None if machine is None else Lifecycle.model_validate(machine.view())


def queue(broker: GpuBroker) -> list[dict[str, object]]:
    """Every waiting request, in arrival order, with its place in line (by priority, then arrival)."""
    entries = broker.scheduler.waiting()
    place = {w["id"]: i + 1 for i, w in enumerate(sorted(entries, key=lambda w: (-w["priority"], w["id"])))}
    return [{**w, "position": place[w["id"]]} for w in entries]


def loading_view(broker: GpuBroker, snap: AttributedSnapshot, tenant: Tenant) -> LoadUnderway | None:
    """The tenant's load on its way to the card, with how far it got on `snap` (`load_events.progress`)."""
    load = broker.loads.underway_of(tenant.name)
    held = tenant_vram(snap, tenant.name)
    if load is None:
        return None
    figure = None if held is None else broker.loads.progress(load, held, tenant.idle_vram_bytes, snap.estimated)
    on_card = figure.on_card_bytes if figure is not None else None
    return LoadUnderway(model=load.model, since=round(load.began_wall, 3),
                        elapsed_s=round(broker.clock.now() - load.began_at, 1),
                        need_bytes=load.need_bytes, need_gb=gib(load.need_bytes), on_card_bytes=on_card,
                        on_card_gb=gib(on_card), estimated=figure is None or figure.estimated)


def _live(broker: GpuBroker, watchdog: Watchdog, snap: AttributedSnapshot, tenant: Tenant,
          state: TenantState) -> dict[str, object]:
    """The live fields /api/tenants and the events' stats frames share (`_TenantLive`)."""
    traffic = broker.inflight.snapshot().get(tenant.name)
    machine = broker.lifecycles.machine(tenant.name)
    # a tenant the proxy stopped (or that is not running) has nothing to release: no countdown
    deadline = None if machine is not None and machine.state != "running" else watchdog.idle_deadline(tenant.name)
    now = broker.clock.now()
    held = tenant_vram(snap, tenant.name)  # None: nobody could see it (no GPU reader, no self-report)
    return {
        "name": tenant.name,
        "vram_bytes": held, "vram_gb": gib(held),
        "busy": state.busy, "busy_reason": state.busy_reason,
        "in_flight": traffic.in_flight if traffic else 0,
        "jobs": list(traffic.jobs) if traffic else [],
        "stale_jobs": list(state.stale_jobs),
        "last_activity_age_s": None if not traffic or traffic.last_activity is None else round(now - traffic.last_activity, 1),
        "idle_release_in_s": None if deadline is None else round(max(0.0, deadline - now), 1),
        "reclaimable": tenant.reclaimable and tenant.name not in broker.cpu_tenants,  # on the CPU: nothing to take
        "waiting": [w for w in queue(broker) if w["tenant"] == tenant.name],
        "loading": loading_view(broker, snap, tenant),
        # several cards: where it loads, what it holds on each (absent on one card)
        **({} if (cards := TenantDevices.of(snap, tenant.name)) is None else {"devices": cards}),
        "lifecycle": lifecycle_view(broker, tenant.name),
        "suspension": (None if (rec := broker.lifecycles.suspensions.record(tenant.name)) is None
                       else Suspended.of(rec)),
    }


def tenant_view(broker: GpuBroker, watchdog: Watchdog, snap: AttributedSnapshot, tenant: Tenant,
                state: TenantState, listening: str | None = None) -> TenantView:
    """One tenant with its configuration and live state (GET /api/tenants, /api/stats, MCP);
    `listening`: where its listener really answers (a port of 0 read back)."""
    return TenantView.model_validate({
        **_live(broker, watchdog, snap, tenant, state),
        "config": tenant.model_dump(mode="json"),
        "processes": [tenant_process(p) for p in snap.processes_of(tenant.name)],
        "watchdog": watchdog.last.reasons.get(tenant.name) if watchdog.last else None,
        "estimated": snap.snapshot.source == "engine-estimate",
        "listening": listening,
    })


def stats_tenant(broker: GpuBroker, watchdog: Watchdog, snap: AttributedSnapshot, tenant: Tenant,
                 state: TenantState) -> StatsTenant:
    """One tenant in an events stats frame: the live state, small (no config, no catalog)."""
    return StatsTenant.model_validate({**_live(broker, watchdog, snap, tenant, state), "engine": tenant.engine,
                                       "priority": tenant.priority,
                                       "pids": [p.process.pid for p in snap.processes_of(tenant.name)]})
