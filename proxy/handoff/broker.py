"""The GPU broker: the request side's port to the scheduler (a GPU request's need estimated, then
admitted at once or through the handoff queue; the dry-run plan), and the assembly of what the
scheduler does to the world (`HandoffEffects`), each part an object of its own:
- `CardReader` (card_reader.py): one GPU read at a time off the loop, falling back to the engines'
  own reports, every reading posted to the scheduler;
- `ReleaseRunner` (release_runner.py): a release asked for and confirmed on the card;
- `Starter` (starter.py): a tenant that sleeps woken, started or preloaded, its memory planned like
  a load's; what the proxy suspended restored at its stop.

No admission state lives here: waiters, admitted work, reservations, residency, the engines' reads
and the latest card are the `Scheduler`'s (proxy/handoff/scheduler.py), which runs every read and
release as a task that reports back. Who is busy is the pure rule in `busy.py`; who runs, waits or
is refused is the pure `policy.schedule`. The HTTP side (answers, the OOM retry) is the GPU gate
in proxy/relay/gpu_gate.py. What the broker and its parts ask an engine is `BrokerPorts`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.engines import AdapterCache, Need
from proxy.engines.ports import BrokerPorts
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import GpuReader, GpuReadError
from proxy.handoff import per_card
from proxy.handoff.busy import CONFIRM_SLACK_BYTES
from proxy.handoff.card_reader import CardReader
from proxy.handoff.decisions import DecisionLog, ReleaseResult
from proxy.handoff.inflight import InFlight, Token
from proxy.handoff.load_events import LoadEvents
from proxy.handoff.oom_need import OOM_HEADROOM_BYTES, oom_retry_need
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import Plan, PlanMode, gib, unplanned_plan
from proxy.handoff.policy import promised_by_tenant
from proxy.handoff.release_runner import ReleaseRunner
from proxy.handoff.scheduler import Admitted, Handoff, Scheduler
from proxy.handoff.sleepers import Lifecycles
from proxy.handoff.starter import Starter
from proxy.lifecycle.cuda_driver import Checkpointer
from proxy.tls import client_context

__all__ = ["CONFIRM_SLACK_BYTES", "Admitted", "GpuBroker", "Handoff", "ReleaseResult", "gib"]


class GpuBroker:
    def __init__(self, registry: Registry, reader: GpuReader, inflight: InFlight, clock: Clock,
                 decisions: DecisionLog, control: httpx.AsyncClient | None = None,
                 adapter: Callable[[Tenant], BrokerPorts] | None = None, *,
                 lifecycles: Lifecycles | None = None, state_dir: Path | None = None,
                 checkpointer: Checkpointer | None = None) -> None:
        self.registry = registry
        self.inflight = inflight
        self.clock = clock
        self.decisions = decisions
        self.control = control or httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False,
                                                    verify=client_context())
        # Each tenant's engine adapter (the proxy's, when the service passes it): one per tenant,
        # so what an adapter learns (Ollama's model sizes) is learnt once.
        self.adapter: Callable[[Tenant], BrokerPorts] = adapter or AdapterCache()
        # residency is confirmed again every watchdog tick; a load unconfirmed for two ticks is planned for again
        self.scheduler = Scheduler(self, inflight, fresh_s=2 * registry.config.proxy.watchdog_interval_s + 0.5,
                                   runs_at_once=lambda name: self.adapter(registry.get(name)).runs_at_once)
        self.card_reader = CardReader(registry, reader, clock, self.control, self.adapter, self.scheduler.observe_card)
        # tenants the proxy stops and starts, or that owe a resume: started before their next request
        self.lifecycles = lifecycles or Lifecycles(registry, self.adapter, clock, decisions, self.control,
                                                   state_dir=state_dir, checkpointer=checkpointer)
        self.lifecycles.on_change.append(lambda _tenant: self.scheduler.kick())
        self.releases = ReleaseRunner(registry, clock, decisions, inflight, self.scheduler, self.lifecycles,
                                      self.control, self.adapter, self.card_reader)
        self.starter = Starter(registry, decisions, self.scheduler, self.lifecycles, self.adapter, self.card_reader)
        self.started_at = clock.now()  # idle deadlines of tenants never seen active count from here
        # loads as events (ahead, begun, on the card, ended): warming and load timing subscribe to them
        self.loads = LoadEvents(clock)

    @property
    def last_snapshot(self) -> AttributedSnapshot | None:
        """The latest card reading (the scheduler's), for views; None before the first read."""
        return self.scheduler.card

    @property
    def cpu_tenants(self) -> frozenset[str]:
        return self.scheduler.cpu_tenants

    # -- reading the card (the card reader's) -------------------------------------------------------
    @property
    def reader(self) -> GpuReader:
        """The GPU reader the card reader reads (a test or a bench swaps it for a broken one)."""
        return self.card_reader.reader

    @reader.setter
    def reader(self, reader: GpuReader) -> None:
        self.card_reader.reader = reader

    @property
    def last_read_error(self) -> GpuReadError | None:
        """The GPU reader's own health, for /api/health: None while it reads."""
        return self.card_reader.last_read_error

    async def snapshot(self) -> AttributedSnapshot:
        """Read the card now (`CardReader.read`: one read at a time, posted to the scheduler)."""
        return await self.card_reader.read()

    def held(self, snap: AttributedSnapshot, tenant: str) -> int:
        return snap.held_by(tenant)

    # -- planning -----------------------------------------------------------------------------
    async def plan(self, requester: str, need_bytes: int, key: str = "",
                   snap: AttributedSnapshot | None = None, *, mode: PlanMode = "request") -> tuple[Plan, AttributedSnapshot]:
        """The plan a request would get now (the dry run of `GET /api/plan`, the watchdog's relief)."""
        self.registry.get(requester)
        snap = snap or await self.snapshot()
        if not snap.snapshot.device.size_known:  # as the handoff queue does: forwarded without a plan
            return unplanned_plan(requester, need_bytes), snap
        plan = per_card.plan_on_devices(snap, self.registry, self.scheduler.states(snap), requester, need_bytes,
                                       promised=promised_by_tenant(self.scheduler.promised(snap), key or requester),
                                       mode=mode)
        return plan, snap

    # -- the scheduler's effects (HandoffEffects) ------------------------------------------------
    async def read_card(self) -> AttributedSnapshot:
        return await self.card_reader.read()

    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        """`ReleaseRunner.carry_out`: the effect behind `Scheduler.release`, run by it as a task."""
        return await self.releases.carry_out(order, fresh)

    def prepare_load(self, tenant: str, model: str) -> None:
        self.loads.ahead(tenant, model)

    # -- the request path ---------------------------------------------------------------------
    async def admit(self, tenant: Tenant, path: str, body: bytes, trigger: str,
                    *, oom: bool = False, work: Token | None = None, need: Need | None = None) -> tuple[Admitted, Need]:
        """Make room for a GPU request: at once when its load is already on the card (the scheduler's
        own first step, `Scheduler.admit_at_once`), else through the handoff queue (which may
        wait for busy tenants, up to the queue timeout). `work`: the request's traffic token, counted
        as the tenant's work from its admission on; `need`: estimated already. A client that goes
        away while waiting leaves the queue."""
        need = need or await self.adapter(tenant).estimate_need(path, body, self.control)
        need_bytes = need.bytes
        if oom:  # planned on a fresh reading, the raise capped at what the tenant can reach (handoff/oom_need.py)
            self.scheduler.unloaded(tenant.name)
            snap = await self.snapshot()
            held, free = self.held(snap, tenant.name), per_card.free_for(snap, tenant.name)
            reachable = None
            if snap.snapshot.device.size_known:  # a plan short of memory counts every tenant it could reach
                probe, _ = await self.plan(tenant.name, held + free + OOM_HEADROOM_BYTES, need.key, snap)
                reachable = probe.reachable_bytes
            need_bytes = oom_retry_need(need_bytes, held, free, reachable)
        elif (at_once := self.scheduler.admit_at_once(tenant, need.key, need_bytes, work)) is not None:
            return at_once, need
        admitted = await self.scheduler.request(tenant, need.key, need_bytes, trigger, "oom_retry" if oom else "plan",
                                            model=need.model, work=work)
        if admitted.outcome == "run" and self.lifecycles.suspensions.dormant(tenant.name):
            # suspended while it waited (its wake came first): restored before it is forwarded
            await self.lifecycles.wake(tenant)
        return admitted, need

    async def aclose(self) -> None:
        await self.scheduler.aclose()
        await self.starter.restore_at_stop()
        await self.lifecycles.aclose()
        await self.control.aclose()
