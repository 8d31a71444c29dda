"""`GET /metrics` on the admin listener: Prometheus text format, one CollectorRegistry per proxy.

Gauges are read at scrape time from the proxy's owners (the last GPU snapshot, the in-flight
counts) by a custom collector; counters and the handoff histogram are fed by observing the
decision log and the in-flight changes, never by hooks in the request path. No pid labels (pids
churn and would explode the series count).

Series:
- hyperswap_gpu_memory_{total,used,free}_bytes, hyperswap_tenant_vram_bytes{tenant},
  hyperswap_unmanaged_vram_bytes, hyperswap_gpu_snapshot_age_seconds,
  hyperswap_gpu_snapshot_source_info{source,device}: from `broker.last_snapshot` (one GPU
  read if none was taken yet). source is nvml | simulated | engine-estimate. A figure nobody
  measured has no sample (never a 0): without a GPU reader the unmanaged VRAM, the tenants that
  report nothing about themselves, and the card's used/free (and total, when no engine reports it).
- On a host with several GPUs the three memory gauges are the whole host's sums, and each card has
  hyperswap_gpu_card_memory_{total,used,free}_bytes{index,name} and
  hyperswap_tenant_card_vram_bytes{tenant,index} (absent on one card).
- hyperswap_inflight_requests{tenant}, hyperswap_queued_jobs{tenant}: from `InFlight`.
- hyperswap_requests_total{tenant,outcome}: GPU requests that left flight (pass-through requests
  are not counted in flight, so not here). outcome: `rejected` (answered 507), `oom_error` (the
  engine's OOM reached the client: the retry failed or had no plan), `retried` (the engine ran out
  of memory and the retry succeeded: the client got its answer), else by the status the client
  got: `completed` (below 400), `client_error` (4xx), `server_error` (5xx: the engine's, or the
  proxy's 502/503/504), `unanswered` (the client left before any answer). A ComfyUI prompt retried
  after an OOM is counted by its POST /prompt, answered long before: its retry is counted in
  hyperswap_oom_retries_total only. A 200 stream that ends
  with an error line counts as completed (the status is all that is known). A 507 or OOM decision
  is recorded before its request leaves flight, so the next departure of that tenant is counted
  with that outcome: the totals are exact, the pairing with one request is not.
- hyperswap_handoff_seconds: histogram of the time handoffs spent releasing (sum of the releases'
  duration_s) for decisions from the planner with at least one release: kinds plan, oom_retry, spill.
- hyperswap_releases_total{tenant,result}: every executed release (requests, watchdog, admin);
  result confirmed (the card showed the memory back) | estimated (no GPU reader: the engine's own
  report said so) | timeout (memory not back in time) | error (the engine refused or was down).
- hyperswap_oom_retries_total{tenant,result}: each retry's result, the part before any ":" of the
  `oom_retry` decision's: succeeded | failed | no plan (the queue refused it: 507 or its timeout) |
  requeued (a ComfyUI prompt queued again under its own id; it then counts succeeded or failed once
  it ends) | re-queue refused | re-queue failed | not retried (the prompt was not in ComfyUI's history).
- hyperswap_rejections_total{tenant}: 507s.
- hyperswap_queue_waiting{tenant}: requests waiting in the handoff queue now (from the queue).
- hyperswap_queue_wait_seconds: histogram of how long requests that had to wait waited, however
  it ended (admitted, 507, 503, client left), from the `QueueEnded` events.
- hyperswap_queue_timeouts_total{tenant}: 503s after `proxy.queue_timeout_s`.
- hyperswap_model_load_gbps{tenant,class}: histogram of model load speeds the engines reported (Ollama's
  load_duration and the model's size), from the `model_load` decisions; class warm | cold | unknown
  (proxy/models/loads.py: split by this machine's own loads).
- Tenants the proxy starts and stops (release kind process, systemd, docker), from
  `Lifecycles.on_report` (every start and stop that ran; a refused one never began):
  hyperswap_lifecycle_starts_total{tenant} (starts that ended ready),
  hyperswap_lifecycle_failed_starts_total{tenant} (failed or timed out),
  hyperswap_lifecycle_start_seconds{tenant} (histogram: from the start to ready, successful starts),
  hyperswap_lifecycle_stops_total{tenant,result} (result ok | failed),
  hyperswap_lifecycle_exits_total{tenant,result} (it ended on its own while running: ok is exit code 0,
  failed any other end or no answer to its probe); and at scrape time
  hyperswap_lifecycle_state{tenant,state}: 1 for the state it is in, 0 for the others.
- For a cluster's inference router (the Gateway API Inference Extension's endpoint picker, mapped by an
  `engineConfigs` entry: docs/guides/several-machines.md), per tenant, from the scheduler at scrape time
  (proxy/handoff/signals.py): hyperswap_tenant_requests_waiting{tenant} (the handoff queue, plus jobs
  queued in the engine behind the one it runs; the picker's queued requests),
  hyperswap_tenant_requests_running{tenant} (admitted requests in flight, plus the job the engine runs),
  hyperswap_tenant_memory_cost{tenant} (0-1, what a new load would cost: (0.25 x bytes from free memory
  + 0.5 x bytes from idle tenants released + 1 x bytes a busy tenant must give up) / the load's bytes, split
  by the scheduler's own planner; the load is needs_vram_gb, 0 when the tenant holds it; for an engine that
  sizes each model (Ollama) it is all the memory the tenant could reach, its own models counted at 0.5, or 1
  while it is busy; 1 when no plan fits; no sample while the card's size is unknown; as of the last card
  reading, which the watchdog takes every watchdog_interval_s), and
  hyperswap_tenant_models_info{tenant,running_lora_adapters,waiting_lora_adapters,max_lora} (the LoRA-info
  shape the affinity scorer reads: comma-separated model names on the card and on their way there, a
  `:latest` tag listed bare too; max_lora their count, so the card counts as full; the value is the
  reading's Unix time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.admin.proxy_view import ProxyView
from proxy.decision_base import DecisionEvent
from proxy.gpu.visibility import Card, Device, tenant_vram, unmanaged_vram
from proxy.handoff.decisions import HandoffFinished, ModelLoad, OomRetry, QueueEnded, Rejected
from proxy.handoff.signals import gather
from proxy.lifecycle.state import LifecycleReport

if TYPE_CHECKING:
    from proxy.gpu.attribution import AttributedSnapshot

# From a network disk's tenth of a GB/s to RAM at several GB/s.
LOAD_GBPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
# Handoffs on real cards take from a fraction of a second (Ollama unload) to tens (a big ComfyUI free).
HANDOFF_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
HANDOFF_KINDS = ("plan", "oom_retry", "spill")
# A wait lasts as long as the busy tenant's job: a chat's seconds to a long render's minutes.
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PENDING_MAX = 1024  # outcomes waiting for their request to leave flight, per tenant
# A server's start to ready: a small model's second to a large one's minutes.
START_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
LIFECYCLE_STATES = ("running", "stopped", "starting", "stopping", "failed", "exited")

# Every family the live collector can yield: name -> (help, labels). `describe()` lists them all, also
# those that appear only on some hosts (several cards, tenants the proxy starts), for the registry's name
# check and the generated metrics reference (docs/reference/metrics.md).
LIVE_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "hyperswap_gpu_memory_total_bytes": ("GPU memory on the card", ()),
    "hyperswap_gpu_memory_used_bytes": ("GPU memory in use, every process", ()),
    "hyperswap_gpu_memory_free_bytes": ("GPU memory free", ()),
    "hyperswap_gpu_snapshot_age_seconds": ("Seconds since the GPU snapshot these figures come from", ()),
    "hyperswap_tenant_vram_bytes": ("GPU memory held by a tenant's processes", ("tenant",)),
    "hyperswap_unmanaged_vram_bytes": ("GPU memory held by processes no tenant matches", ()),
    "hyperswap_gpu_card_memory_total_bytes": ("GPU memory on one card", ("index", "name")),
    "hyperswap_gpu_card_memory_used_bytes": ("GPU memory in use on one card", ("index", "name")),
    "hyperswap_gpu_card_memory_free_bytes": ("GPU memory free on one card", ("index", "name")),
    "hyperswap_tenant_card_vram_bytes": ("GPU memory a tenant's processes hold on one card", ("tenant", "index")),
    "hyperswap_inflight_requests": ("GPU requests in flight through the proxy", ("tenant",)),
    "hyperswap_queued_jobs": ("Engine jobs the proxy saw queued and not yet finished", ("tenant",)),
    "hyperswap_queue_waiting": ("Requests waiting in the handoff queue for GPU memory", ("tenant",)),
    "hyperswap_lifecycle_state": ("A tenant the proxy starts and stops: 1 for the state it is in", ("tenant", "state")),
    # For a cluster's inference router (the Inference Extension's endpoint picker): proxy/handoff/signals.py
    "hyperswap_tenant_requests_waiting": ("Requests waiting: in the handoff queue for memory, plus jobs queued in the "
                                          "engine behind the one it runs", ("tenant",)),
    "hyperswap_tenant_requests_running": ("Requests running: admitted requests in flight, plus the job the engine runs",
                                          ("tenant",)),
    "hyperswap_tenant_memory_cost": ("What a new load would cost in memory, 0-1: 0 its model is on the card, 0.25 a "
                                     "load into free memory, 0.5 idle tenants released, 1 a busy tenant must finish",
                                     ("tenant",)),
    "hyperswap_tenant_models_info": ("Models on the card (running_lora_adapters) and on their way (waiting_lora_adapters), "
                                     "max_lora their count; the value is the reading's Unix time",
                                     ("tenant", "running_lora_adapters", "waiting_lora_adapters", "max_lora")),
}
SNAPSHOT_SOURCE = ("hyperswap_gpu_snapshot_source", "Where the GPU figures come from", ("source", "device"))


def _gauge(name: str) -> GaugeMetricFamily:
    help_, labels = LIVE_GAUGES[name]
    return GaugeMetricFamily(name, help_, labels=list(labels) if labels else None)


def _source_info() -> InfoMetricFamily:
    name, help_, labels = SNAPSHOT_SOURCE
    return InfoMetricFamily(name, help_, labels=list(labels))


class _LiveCollector(Collector):
    """Gauges computed at scrape time: nothing to keep in sync."""

    def __init__(self, proxy: ProxyView) -> None:
        self.proxy = proxy

    def describe(self) -> Iterable[Metric]:
        """Every family `collect` may yield, without samples."""
        return [*(_gauge(name) for name in LIVE_GAUGES), _source_info()]

    def collect(self) -> Iterable[Metric]:
        proxy = self.proxy
        tenants = [t.name for t in proxy.registry]
        snap = proxy.broker.last_snapshot
        yield from _memory_families(proxy, snap, tenants)
        if snap is not None and snap.snapshot.several_devices:
            yield from _card_families(snap)
        yield from _traffic_families(proxy, tenants)
        yield _waiting_family(proxy, tenants)
        yield from _picker_families(proxy, snap)
        yield from _lifecycle_families(proxy)


def _memory_families(proxy: ProxyView, snap: AttributedSnapshot | None, tenants: list[str]) -> list[Metric]:
    """The card's memory (one card: its figures; several: the host's sums), the snapshot's age, each
    tenant's VRAM, the unmanaged VRAM and where the figures come from; families without samples when
    there is no snapshot yet."""
    total = _gauge("hyperswap_gpu_memory_total_bytes")
    used = _gauge("hyperswap_gpu_memory_used_bytes")
    free = _gauge("hyperswap_gpu_memory_free_bytes")
    age = _gauge("hyperswap_gpu_snapshot_age_seconds")
    held = _gauge("hyperswap_tenant_vram_bytes")
    unmanaged = _gauge("hyperswap_unmanaged_vram_bytes")
    source = _source_info()
    if snap is not None:
        whole = Device.of(snap)  # one card: its figures; several: the host's sums
        # unknown is not zero: a figure nobody measured gets no sample at all
        for family, value in ((total, whole.total_bytes), (used, whole.used_bytes), (free, whole.free_bytes),
                              (unmanaged, unmanaged_vram(snap))):
            if value is not None:
                family.add_metric([], value)
        age.add_metric([], max(0.0, proxy.clock.now() - snap.snapshot.taken_at))
        for name in tenants:
            vram = tenant_vram(snap, name)
            if vram is not None:
                held.add_metric([name], vram)
        source.add_metric([snap.snapshot.source, whole.name], {})
    return [total, used, free, age, held, unmanaged, source]


def _traffic_families(proxy: ProxyView, tenants: list[str]) -> list[Metric]:
    """Requests in flight and jobs queued, per tenant (0 for a tenant with no traffic)."""
    traffic = proxy.inflight.snapshot()
    inflight = _gauge("hyperswap_inflight_requests")
    jobs = _gauge("hyperswap_queued_jobs")
    for name in tenants:
        t = traffic.get(name)
        inflight.add_metric([name], t.in_flight if t else 0)
        jobs.add_metric([name], len(t.jobs) if t else 0)
    return [inflight, jobs]


def _waiting_family(proxy: ProxyView, tenants: list[str]) -> Metric:
    """Requests waiting in the scheduler's queue, per tenant (0 for every configured tenant)."""
    waiting = _gauge("hyperswap_queue_waiting")
    counts: dict[str, int] = {name: 0 for name in tenants}
    for w in proxy.broker.scheduler.waiting():
        counts[w["tenant"]] = counts.get(w["tenant"], 0) + 1
    for name, n in counts.items():
        waiting.add_metric([name], n)
    return waiting


def _lifecycle_families(proxy: ProxyView) -> list[Metric]:
    """Each managed app's lifecycle state as a one-hot gauge; nothing when no app is managed."""
    machines = proxy.broker.lifecycles.machines()
    if not machines:
        return []
    state = _gauge("hyperswap_lifecycle_state")
    for name, machine in machines.items():
        for s in LIFECYCLE_STATES:
            state.add_metric([name, s], 1 if machine.state == s else 0)
    return [state]


def _picker_families(proxy: ProxyView, snap: AttributedSnapshot | None) -> list[Metric]:
    """The signals a cluster's endpoint picker scrapes, per tenant (proxy/handoff/signals.py)."""
    waiting = _gauge("hyperswap_tenant_requests_waiting")
    running = _gauge("hyperswap_tenant_requests_running")
    cost = _gauge("hyperswap_tenant_memory_cost")
    models = _gauge("hyperswap_tenant_models_info")
    now = proxy.clock.wall()
    for s in gather(proxy.broker.scheduler, proxy.registry, snap):
        waiting.add_metric([s.tenant], s.waiting)
        running.add_metric([s.tenant], s.running)
        if s.memory_cost is not None:  # the card's size is unknown: no sample, never a 0
            cost.add_metric([s.tenant], s.memory_cost)
        # max_lora = the models it holds: the card counts as full, so the picker's affinity prefers the
        # node that has the model (or loads it) over one that would have to load it; the cost says how dear.
        models.add_metric([s.tenant, ",".join(s.resident), ",".join(s.loading), str(s.models)], now)
    return [waiting, running, cost, models]


def _card_families(snap: AttributedSnapshot) -> list[Metric]:
    """Several GPUs: each card's memory and what each tenant holds on it."""
    total = _gauge("hyperswap_gpu_card_memory_total_bytes")
    used = _gauge("hyperswap_gpu_card_memory_used_bytes")
    free = _gauge("hyperswap_gpu_card_memory_free_bytes")
    held = _gauge("hyperswap_tenant_card_vram_bytes")
    for card in Card.all_of(snap):
        key = [str(card.index), card.name]
        for family, value in ((total, card.total_bytes), (used, card.used_bytes), (free, card.free_bytes)):
            if value is not None:
                family.add_metric(key, value)
        for tenant, n in card.tenants.items():
            held.add_metric([tenant, str(card.index)], n)
    return [total, used, free, held]


class Metrics:
    """The /metrics extension."""

    name = "metrics"

    def __init__(self, proxy: ProxyView) -> None:
        self.proxy = proxy
        self.registry = CollectorRegistry(auto_describe=False)
        self.live = _LiveCollector(proxy)
        self.registry.register(self.live)
        self.requests = Counter("hyperswap_requests", "GPU requests that left flight, by outcome",
                                ["tenant", "outcome"], registry=self.registry)
        self.handoff = Histogram("hyperswap_handoff_seconds", "Time a handoff spent releasing memory",
                                 buckets=HANDOFF_BUCKETS, registry=self.registry)
        self.releases = Counter("hyperswap_releases", "Executed releases, by the released tenant and result",
                                ["tenant", "result"], registry=self.registry)
        self.oom_retries = Counter("hyperswap_oom_retries", "OOM answers reclaimed and retried, by result",
                                   ["tenant", "result"], registry=self.registry)
        self.rejections = Counter("hyperswap_rejections", "Requests answered 507 (no plan frees enough)",
                                  ["tenant"], registry=self.registry)
        self.waits = Histogram("hyperswap_queue_wait_seconds", "How long requests that had to wait for memory waited",
                               buckets=WAIT_BUCKETS, registry=self.registry)
        self.load_speed = Histogram("hyperswap_model_load_gbps", "Model load speed (GB/s of 1e9 bytes), warm or cold",
                                    ["tenant", "class"], buckets=LOAD_GBPS_BUCKETS, registry=self.registry)
        self.timeouts = Counter("hyperswap_queue_timeouts", "Requests answered 503 after proxy.queue_timeout_s",
                                ["tenant"], registry=self.registry)
        self.starts = Counter("hyperswap_lifecycle_starts", "Starts of a tenant the proxy starts that ended ready",
                              ["tenant"], registry=self.registry)
        self.failed_starts = Counter("hyperswap_lifecycle_failed_starts", "Starts that failed or timed out",
                                     ["tenant"], registry=self.registry)
        self.start_seconds = Histogram("hyperswap_lifecycle_start_seconds", "From a start to ready (successful starts)",
                                       ["tenant"], buckets=START_BUCKETS, registry=self.registry)
        self.stops = Counter("hyperswap_lifecycle_stops", "Stops of a tenant the proxy starts, by result",
                             ["tenant", "result"], registry=self.registry)
        self.exits = Counter("hyperswap_lifecycle_exits", "Ends on its own while running of a tenant the proxy starts "
                             "(result ok: exit code 0; failed: any other code, a signal, no answer)",
                             ["tenant", "result"], registry=self.registry)
        self._pending: dict[str, list[str]] = {}  # tenant -> outcomes of requests about to leave flight
        self._unsubscribe: Callable[[], None] | None = None
        for tenant in proxy.registry:  # series exist from the first scrape, at zero
            for outcome in REQUEST_OUTCOMES:
                self.requests.labels(tenant.name, outcome)
            self.rejections.labels(tenant.name)
            self.timeouts.labels(tenant.name)
        for name in proxy.broker.lifecycles.machines():
            self.starts.labels(name)
            self.failed_starts.labels(name)
            self.start_seconds.labels(name)
            for result in ("ok", "failed"):
                self.stops.labels(name, result)
                self.exits.labels(name, result)

    # -- extension ----------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [Route("/metrics", self.scrape, methods=["GET"])]

    async def start(self) -> None:
        self._unsubscribe = self.proxy.decisions.subscribe(self.on_decision)
        self.proxy.inflight.on_departure.append(self.on_departure)
        self.proxy.broker.lifecycles.on_report.append(self.on_lifecycle)

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.on_lifecycle in self.proxy.broker.lifecycles.on_report:
            self.proxy.broker.lifecycles.on_report.remove(self.on_lifecycle)
        if self.on_departure in self.proxy.inflight.on_departure:
            self.proxy.inflight.on_departure.remove(self.on_departure)

    async def scrape(self, request: Request) -> Response:
        if self.proxy.broker.last_snapshot is None:
            await self.proxy.broker.snapshot()  # first scrape before any request: read the card once
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    # -- observing ------------------------------------------------------------------------------
    def on_departure(self, tenant: str, status: int | None) -> None:
        pending = self._pending.get(tenant)
        self.requests.labels(tenant, pending.pop(0) if pending else _by_status(status)).inc()

    def on_lifecycle(self, report: LifecycleReport) -> None:
        """A start or stop that ran (a refused one is never reported)."""
        if report.refused:
            return
        if report.action == "exit":
            self.exits.labels(report.tenant, "ok" if report.exit_code == 0 else "failed").inc()
        elif report.action == "start":
            if report.ok:
                self.starts.labels(report.tenant).inc()
                self.start_seconds.labels(report.tenant).observe(report.duration_s)
            else:
                self.failed_starts.labels(report.tenant).inc()
        else:
            self.stops.labels(report.tenant, "ok" if report.ok else "failed").inc()

    def on_decision(self, event: DecisionEvent) -> None:
        """Each event is emitted once, so each counts once."""
        match event:
            case Rejected(status=503):
                self.timeouts.labels(event.tenant).inc()
            case Rejected() if event.answered_request:
                self.rejections.labels(event.tenant).inc()
                self._expect(event.tenant, "rejected")
            case QueueEnded():
                self.waits.observe(event.waited_s)
            case HandoffFinished():
                for r in event.releases:
                    self.releases.labels(r.tenant, r.result).inc()
                if event.releases and event.kind in HANDOFF_KINDS:
                    self.handoff.observe(sum(r.duration_s for r in event.releases))
            case ModelLoad(load=load):
                self.load_speed.labels(event.tenant, load.load_class or "unknown").observe(load.gbps)
            case OomRetry(result=result):
                self.oom_retries.labels(event.tenant, result.split(":", 1)[0]).inc()
                if event.prompt_id is None:  # an HTTP answer retried: its request leaves flight next
                    self._expect(event.tenant, "retried" if result == "succeeded" else "oom_error")

    def _expect(self, tenant: str, outcome: str) -> None:
        pending = self._pending.setdefault(tenant, [])
        if len(pending) < _PENDING_MAX:  # bounded even if a decision ever came without its request
            pending.append(outcome)


REQUEST_OUTCOMES = ("completed", "client_error", "server_error", "unanswered", "rejected", "oom_error", "retried")


def _by_status(status: int | None) -> str:
    """A departed request's outcome from the status its client got (507s and OOMs come from decisions)."""
    if status is None:
        return "unanswered"
    if status < 400:
        return "completed"
    return "client_error" if status < 500 else "server_error"


def metrics_extension(proxy: ProxyView) -> Metrics:
    return Metrics(proxy)
