"""Starting a tenant that sleeps (stopped by the proxy, or suspended into host RAM): its memory is
planned like a load's, through the scheduler (idle tenants released, busy ones waited for, 507
only when impossible), then it is started or resumed. A request that reaches it wakes it (`wake`),
the admin's start starts it (`start`), `preload: true` starts it with the proxy (`preload`); at the
proxy's stop, what it suspended is restored where the card has room (`restore_at_stop`).

    starter = Starter(registry, decisions, scheduler, lifecycles, adapters, card_reader)
    admitted = await starter.wake(tenant, "start of sd for POST /sdapi/v1/txt2img")   # None: awake
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.engines import Need, ReleaseFailed
from proxy.engines.ports import NeedEstimator
from proxy.handoff import per_card
from proxy.handoff.card_reader import CardReader
from proxy.handoff.decisions import DecisionLog, Rejected
from proxy.handoff.plan import gib
from proxy.handoff.scheduler import Admitted, Scheduler
from proxy.handoff.sleepers import Lifecycles
from proxy.lifecycle.state import LifecycleReport

log = logging.getLogger("hyperswap.arbitration")

RESTORE_AT_STOP_S = 60.0  # each restore at the proxy's stop (GiB at ~12 GB/s: seconds)


class Starter:
    def __init__(self, registry: Registry, decisions: DecisionLog, scheduler: Scheduler, lifecycles: Lifecycles,
                 adapter: Callable[[Tenant], NeedEstimator], card_reader: CardReader) -> None:
        self.registry = registry
        self.decisions = decisions
        self.scheduler = scheduler  # a start asks for its memory as a request does, and settles it when up
        self.lifecycles = lifecycles  # the apps the proxy starts, and what it suspended
        self.adapter = adapter
        self.card_reader = card_reader  # a fresh reading, posted to the scheduler

    def start_need(self, tenant: Tenant) -> Need:
        """What a start (or resume) of a sleeping tenant is planned with, under one load key shared by
        every request that wakes it and the admin's start. A suspended tenant's restore needs what it
        parked in host RAM."""
        parked = self.lifecycles.suspensions.parked_bytes(tenant.name)
        if parked:
            return Need(parked, f"the restore of {tenant.name}", f"{tenant.name}:wake")
        return Need(self.adapter(tenant).start_need_bytes, f"the start of {tenant.name}", f"{tenant.name}:wake")

    async def wake(self, tenant: Tenant, trigger: str) -> Admitted | None:
        """A request reached a tenant that is stopped (or owes a resume): make room for it like for a
        load (idle tenants released, busy ones waited for, 507 only when impossible), then start it
        (concurrent requests share one start) or resume it. None: it is awake, forward. An Admitted
        that is not "run" is the queue's refusal or timeout. Raises LifecycleError (503) when the
        start fails."""
        if not self.lifecycles.dormant(tenant.name):
            return None
        need = self.start_need(tenant)
        admitted = await self.scheduler.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            await self.lifecycles.wake(tenant)
        finally:
            self.scheduler.settle(admitted.handoff)  # it is up: what it loaded is on the card, measured from now
        return admitted

    async def start(self, tenant: Tenant, trigger: str) -> Admitted | LifecycleReport:
        """The admin's start of a tenant the proxy starts: room is made for it exactly as for a request
        that wakes it (`wake`), then it is started, past any backoff after a failed start (an explicit
        ask), sharing a start under way. The queue's refusal or timeout (an Admitted that is not
        "run"), or the start's report (ok, or failed with the reason and the app's last lines)."""
        need = self.start_need(tenant)
        admitted = await self.scheduler.request(tenant, need.key, need.bytes, trigger)
        if admitted.outcome != "run":
            return admitted
        try:
            return await self.lifecycles.start(tenant, force=True)
        finally:
            self.scheduler.settle(admitted.handoff)  # it is up (or failed): what it holds is measured from now

    async def preload(self, tenant: Tenant) -> LifecycleReport | None:
        """Start a tenant marked `preload` once the proxy is up, its memory planned like any start
        (`start`). Never raises: how it went is kept on its state machine (`preloaded`), where health
        shows a failure until the app runs; a start that failed is a decision too. None: not started
        (it runs already, or the queue refused or timed out)."""
        machine = self.lifecycles.machine(tenant.name)
        if machine is None or machine.state == "running":
            return None
        try:
            outcome = await self.start(tenant, "preload")
        except Exception as exc:  # a preload never breaks the proxy's start
            log.exception("%s: preload failed", tenant.name)
            machine.preloaded(f"{type(exc).__name__}: {exc}", "see the proxy's log")
            return None
        if isinstance(outcome, Admitted):
            if outcome.outcome == "timeout":
                timeout_s = self.registry.config.proxy.queue_timeout_s
                self.decisions.emit(Rejected(tenant=tenant.name, trigger="preload", plan=outcome.handoff.plan,
                                             status=503, reason=outcome.reason))
                error = f"it waited {timeout_s:g} s for GPU memory: {outcome.reason}"
            else:
                error = f"not enough GPU memory for its start even once every busy tenant finished: {outcome.reason}"
            machine.preloaded(error, f"start it when the memory is free (POST /api/tenants/{tenant.name}/start), or "
                                     f"lower what it needs (tenants.{tenant.name}.needs_vram_gb)")
            return None
        machine.preloaded(None if outcome.ok else outcome.error, outcome.fix)
        return outcome

    async def restore_at_stop(self) -> None:
        """At the proxy's stop, what it suspended is restored where the card has room for it (smallest
        first): left suspended, an app's CUDA calls block for ever with no proxy to restore it. One
        that does not fit is left suspended and named, with the command that restores it (a restore
        without room fails, and the driver does not promise the process survives that)."""
        sus = self.lifecycles.suspensions
        names = sorted((n for n, r in sus.records().items() if r.dormant), key=sus.parked_bytes)
        if not names:
            return
        snap = await self.card_reader.read()
        for name in names:
            need, free = sus.parked_bytes(name), per_card.free_for(snap, name)
            if need > free:
                pids = " ".join(str(p) for p in sus.record(name).pids)  # type: ignore[union-attr]
                log.warning("%s stays suspended at the proxy's stop: %s GiB to restore, %s GiB free on the card; once there "
                            "is room: cuda-checkpoint --toggle --pid %s", name, gib(need), gib(free), pids)
                continue
            try:
                await asyncio.wait_for(sus.restore(name), RESTORE_AT_STOP_S)
            except (ReleaseFailed, TimeoutError) as exc:
                log.warning("%s: not restored at the proxy's stop: %s", name, exc)
                continue
            snap = await self.card_reader.read()
