"""The scheduler against a model of the box, driven at random (hypothesis' stateful testing): its real
policy (`Scheduler`, `policy.schedule`, the busy rule's premise that only admitted work counts)
with fake effects on the manual clock. Random arrivals for three tenants and several models, random
service times, requests the engine fails, clients that leave, releases that are slow, free less than
expected or never answer, memory taken and freed outside the proxy. After every step the invariants
of design.md (3, 5 and 11) are checked:

- liveness: every request is admitted or refused within a bound (no request reaches the queue
  timeout: the timeout is far above the most work any example can queue, so reaching it means a wait
  that nothing would ever end, the deadlock of issue 32);
- a refusal (507) only when nothing could ever make room (the need is above what the card offers
  once every tenant is released: only memory held outside the proxy stays);
- safety: no tenant's memory is released while it has admitted work; an admitted request counts as
  its tenant's work from its admission, and a waiting one never does;
- promised memory never exceeds the card: a load admitted without a failed release behind it fits;
- fairness: no waiter is overtaken by work for what is on the card more than `overtake_limit` times.

The CI run is bounded and derandomized (a fixed seed budget); HYPERSWAP_MODEL_EXAMPLES=N runs N
examples instead (docs/results.md has the result of a long run). A shrunk failure is added below as
a regular test.

Requests arrive by every door of the GPU gate: tried at once then queued (a load on the card), a body
too large to keep (queued, never at once), an OOM retry (never resident) and an unload (loads
nothing, admitted by the scheduler at once). Renders take working memory beside their checkpoint
while they run and ComfyUI runs one at a time, so "the card is never over-committed" is checked when
a load lands and when a request's working memory is taken.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxy.clock import ManualClock, until_all_wait
from proxy.config.registry import Registry
from proxy.config.units import GIB, MIB
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot
from proxy.handoff.decisions import HandoffKind, ReleaseResult
from proxy.handoff.effects import ScriptedEffects
from proxy.handoff.inflight import InFlight, Token
from proxy.handoff.plan import Release
from proxy.handoff.policy import RESIDENT
from proxy.handoff.scheduler import Admitted, Scheduler
from tests.unit.cards import STT, registry

TOTAL = 24 * GIB
RESERVED = 300 * MIB
QUEUE_TIMEOUT_S = 3600.0  # far above the most work an example queues: reaching it is a wait nothing ends
OVERTAKE_LIMIT = 3
# tenant -> model -> bytes the tenant holds with it loaded (one model at a time per tenant here)
MODELS = {
    "ollama": {"gemma": 16 * GIB, "small": 4 * GIB},
    "comfyui": {"sdxl": 7 * GIB, "flux": 12 * GIB},
    "stt": {"whisper": 3 * GIB},
}
TENANTS = sorted(MODELS)
LOAD_S = 2.0  # a model's load from disk to the card
# tenant -> working memory a request takes on top of its model while it runs (a ComfyUI render samples
# beside its checkpoint; Ollama's KV cache is part of what it holds once loaded), given back at its end
WORKING = {"comfyui": int(1.5 * GIB)}
# tenants whose engine runs one request at a time (ComfyUI's one prompt): the rest wait in its own queue
SERIAL = frozenset({"comfyui"})


@dataclass
class Client:
    """One request: its tenant, what it loads, how long it runs once admitted, how it ended."""
    id: int
    tenant: str
    model: str
    need: int
    service_s: float
    arrived: float
    task: asyncio.Task[None] | None = None
    outcome: str | None = None  # run, refuse, timeout, left, oom, error
    admitted_at: float | None = None
    work: Token | None = None
    # The least memory outside the proxy between the request's arrival and its admission: the proxy
    # may have planned on any card read in that time, so what the outside took above it is nothing the
    # proxy could see; a load it over-commits ends as the engine's OOM (the gate's retry), not as a
    # violation. A request riding on another's load is judged with that load's first request.
    outside_seen: int = 0
    fails: bool = False  # the engine answers it with an error at once (nothing loaded)
    # the gate's path: "at_once" (tried at once, then queued), "unkept" (a body too large to keep: queued
    # on the need its head names, never at once), "oom_retry" (the retry after the engine's OOM answer),
    # "unload" (loads nothing: admitted at once by the scheduler, the model leaves the card when idle)
    path: str = "at_once"


class Box(ScriptedEffects):
    """The shipped fake of the effects over a modelled card: each tenant holds its idle floor plus the
    model it loaded last; releases take time and may fail; memory outside the proxy comes and goes."""

    def __init__(self, registry: Registry, clock: ManualClock, inflight: InFlight) -> None:
        # as GpuBroker.carry_out: a busy tenant is never released
        super().__init__(registry, clock, card=self.card_now, release=self.release_one, busy=inflight.busy)
        self.inflight = inflight
        self.loaded: dict[str, str | None] = dict.fromkeys(TENANTS)
        self.outside = 0  # bytes held by a process the proxy does not manage
        self.scheduler: Scheduler | None = None  # told when a release begins, as the real releaser tells it
        self.outside_at_load: dict[str, int] = {}  # load key -> its first request's outside_seen
        self.faults: dict[str, str] = {}  # tenant -> "slow" | "partial" | "hang" for its next release
        self.kept: dict[str, int] = {}  # tenant -> bytes a partial release left behind
        self.failed_releases = 0
        self.violations: list[str] = []
        self.working: dict[int, int] = {}  # client id -> working memory it holds while it runs
        self.engine_locks: dict[str, asyncio.Lock] = {}  # a serial engine's one slot
        self.running: dict[str, set[int]] = {}  # tenant -> ids of the requests it runs now

    def floor(self, tenant: str) -> int:
        return self.registry.get(tenant).idle_vram_bytes

    def held(self, tenant: str) -> int:
        model = self.loaded[tenant]
        working = sum(n for cid, n in self.working.items() if cid in self.running.get(tenant, set()))
        return self.floor(tenant) + (MODELS[tenant][model] if model else 0) + self.kept.get(tenant, 0) + working

    def used(self) -> int:
        return self.outside + sum(self.held(t) for t in TENANTS)

    def card_now(self) -> AttributedSnapshot:
        procs = [(t, i + 1, self.held(t)) for i, t in enumerate(TENANTS)]
        if self.outside:
            procs.append(("unmanaged", 99, self.outside))
        free = max(0, TOTAL - RESERVED - self.used())
        device = DeviceMemory(0, "model card", TOTAL, RESERVED, TOTAL - free - RESERVED, free)
        gps = tuple(GpuProcess(pid, f"{t}-proc", f"{t} --serve", used, float(pid)) for t, pid, used in procs)
        raw = GpuSnapshot(device, gps, source="simulated")
        return AttributedSnapshot(raw, tuple(AttributedProcess(p, "" if t == "unmanaged" else t)
                                             for p, (t, _, _) in zip(gps, procs, strict=True)))

    async def release_one(self, r: Release) -> ReleaseResult:
        """One tenant's release on the modelled card (the fake has checked it is not busy)."""
        fault = self.faults.pop(r.tenant, "ok")
        if self.scheduler is not None:
            self.scheduler.unloaded(r.tenant)  # what it held is on its way off the card
        timeout = self.registry.get(r.tenant).release_timeout_s
        await self.clock.sleep(timeout if fault == "hang" else 4.0 if fault == "slow" else 0.5)
        if self.inflight.busy(r.tenant):
            self.violations.append(f"{r.tenant} released while it had admitted work")
        before = self.held(r.tenant)
        if fault == "hang":
            self.failed_releases += 1
            return ReleaseResult(r.tenant, r.expected_free_bytes, 0, timeout, False, "memory not back", timed_out=True)
        model = self.loaded[r.tenant]
        self.loaded[r.tenant] = None
        if fault == "partial" and model:
            self.kept[r.tenant] = MODELS[r.tenant][model] // 2
            self.failed_releases += 1
        else:
            self.kept.pop(r.tenant, None)
        freed = before - self.held(r.tenant)
        return ReleaseResult(r.tenant, r.expected_free_bytes, freed, 0.5, fault != "partial")


class SchedulerModel(RuleBasedStateMachine):
    SWAP_HOLD_S = 0.0  # proxy.swap_hold_s: off

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock(start=0.0)
        self.inflight = InFlight(self.clock)
        reg = registry({"stt": STT}, proxy={"queue_timeout_s": QUEUE_TIMEOUT_S, "overtake_limit": OVERTAKE_LIMIT,
                                            "starvation_after_s": 60.0, "swap_hold_s": self.SWAP_HOLD_S})
        self.box = Box(reg, self.clock, self.inflight)
        self.queue = Scheduler(self.box, self.inflight)
        self.box.scheduler = self.queue
        self.clients: list[Client] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            # every request ends: time runs on until nothing is left (liveness, checked at the end too)
            for _ in range(200):
                if all(c.outcome is not None for c in self.clients):
                    break
                self.run(self.clock.advance(30.0))
            self.check_liveness(final=True)
            assert not self.box.violations, self.box.violations
        finally:
            for c in self.clients:
                if c.task is not None:
                    c.task.cancel()
            self.run(self.queue.aclose())
            self.run(until_all_wait())
            self.loop.close()

    # -- a request's life ----------------------------------------------------------------------
    async def _client(self, c: Client) -> None:
        tenant = self.box.registry.get(c.tenant)
        key = f"{c.tenant}:{c.model}"
        c.work = self.inflight.begin(c.tenant, admitted=False)
        try:
            if c.path == "unload":
                self.queue.admit_unplanned(c.work, c.tenant, key)
                if not self.box.running.get(c.tenant) and self.box.loaded[c.tenant] == c.model:
                    self.box.loaded[c.tenant] = None  # the engine unloads it (it runs nothing of it now)
                c.outcome = "run"
                return
            admitted = self.queue.admit_at_once(tenant, key, c.need, c.work) if c.path == "at_once" else None
            if admitted is None:
                kind: HandoffKind = "oom_retry" if c.path == "oom_retry" else "plan"
                admitted = await self.queue.request(tenant, key, c.need, f"request {c.id}", kind, work=c.work)
            await self._served(c, admitted)
        except asyncio.CancelledError:
            c.outcome = c.outcome or "left"
        finally:
            self.inflight.end(c.work)

    async def _served(self, c: Client, admitted: Admitted) -> None:
        if admitted.outcome != "run":
            c.outcome = admitted.outcome
            if admitted.outcome == "refuse":
                room = TOTAL - RESERVED - self.box.outside
                if c.need <= room:
                    self.box.violations.append(f"request {c.id} ({c.tenant} {c.need / GIB:g} GiB) refused (507) though "
                                               f"{room / GIB:g} GiB could be made free: {admitted.reason}")
            return
        c.admitted_at = self.clock.now()
        key = f"{c.tenant}:{c.model}"
        if admitted.reason == RESIDENT and key in self.box.outside_at_load:
            c.outside_seen = min(c.outside_seen, self.box.outside_at_load[key])
        else:
            self.box.outside_at_load[key] = c.outside_seen
        if c.work is None or not self.inflight.admitted(c.work):
            self.box.violations.append(f"request {c.id} admitted but not counted as {c.tenant}'s work")
        serial = c.tenant in SERIAL
        slot = self.box.engine_locks.setdefault(c.tenant, asyncio.Lock()) if serial else None
        try:
            if slot is not None:
                await slot.acquire()  # the engine's own queue: one job at a time
            if c.fails:
                c.outcome = "error"
                return
            if self.box.loaded[c.tenant] != c.model:
                await self.clock.sleep(LOAD_S)
            if self.box.loaded[c.tenant] != c.model:  # this request's load (not one that another brought meanwhile)
                self.box.loaded[c.tenant] = c.model
                self.box.kept.pop(c.tenant, None)  # the engine drops the rest when it loads anew
                if not self._fits(c, "load of"):
                    self.box.loaded[c.tenant] = None
                    return
            self.queue.loaded(c.tenant, f"{c.tenant}:{c.model}")  # the engine answered: on the card
            if not serial:
                self.queue.settle(admitted.handoff)  # the answer ended the load's promise; a job's lasts to its end
            self.box.running.setdefault(c.tenant, set()).add(c.id)
            self.box.working[c.id] = WORKING.get(c.tenant, 0)
            if not self._fits(c, "working memory of"):
                return
            await self.clock.sleep(c.service_s)
            c.outcome = "run"
        finally:
            self.box.working.pop(c.id, None)
            self.box.running.get(c.tenant, set()).discard(c.id)
            if slot is not None and slot.locked():
                slot.release()
            self.queue.settle(admitted.handoff)

    def _fits(self, c: Client, what: str) -> bool:
        """The card holds what `c` just took; else the engine's OOM (a failed release or memory taken
        outside the proxy behind it) or a violation (the proxy over-committed the card)."""
        if self.box.used() <= TOTAL - RESERVED:
            return True
        grown_outside = max(0, self.box.outside - c.outside_seen)  # nothing the proxy could see coming
        if self.box.failed_releases or self.box.used() - grown_outside <= TOTAL - RESERVED:
            c.outcome = "oom"  # a failed release let it run short: the engine's OOM answer
            return False
        self.box.violations.append(f"request {c.id}'s {what} {c.tenant}:{c.model} over-committed the card "
                                   f"({self.box.used() / GIB:g} GiB used) with no failed release behind it")
        return False

    # -- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.clients) < 14)
    @rule(tenant=st.sampled_from(TENANTS), pick=st.integers(0, 1), service_s=st.sampled_from([0.2, 1.0, 5.0, 20.0]),
          fails=st.sampled_from([False, False, False, True]))
    def arrive(self, tenant: str, pick: int, service_s: float, fails: bool) -> None:
        """A request; `fails`: its engine answers an error at once, before loading anything."""
        models = sorted(MODELS[tenant])
        model = models[pick % len(models)]
        c = Client(len(self.clients), tenant, model, MODELS[tenant][model] + self.box.floor(tenant) + WORKING.get(tenant, 0),
                   service_s,
                   self.clock.now(), outside_seen=self.box.outside, fails=fails)
        c.task = self.loop.create_task(self._client(c))
        self.clients.append(c)
        self.run(until_all_wait())

    @precondition(lambda self: len(self.clients) < 14)
    @rule(tenant=st.sampled_from(TENANTS), pick=st.integers(0, 1), service_s=st.sampled_from([0.2, 1.0, 5.0]),
          path=st.sampled_from(["unkept", "oom_retry", "unload"]))
    def arrive_by_another_path(self, tenant: str, pick: int, service_s: float, path: str) -> None:
        """A request by the gate's other doors: a body too large to keep, an OOM retry, an unload."""
        models = sorted(MODELS[tenant])
        model = models[pick % len(models)]
        c = Client(len(self.clients), tenant, model, MODELS[tenant][model] + self.box.floor(tenant) + WORKING.get(tenant, 0),
                   service_s, self.clock.now(), outside_seen=self.box.outside, path=path)
        c.task = self.loop.create_task(self._client(c))
        self.clients.append(c)
        self.run(until_all_wait())

    @precondition(lambda self: len(self.clients) < 14)
    @rule()
    def arrive_impossible(self) -> None:
        """A need no release can meet: refused at once, whatever else waits."""
        c = Client(len(self.clients), "ollama", "huge", 40 * GIB, 1.0, self.clock.now())
        c.task = self.loop.create_task(self._client(c))
        self.clients.append(c)
        self.run(until_all_wait())

    @rule(dt=st.sampled_from([0.15, 0.5, 2.0, 10.0]))
    def time_passes(self, dt: float) -> None:
        self.run(self.clock.advance(dt))
        self.watchdog_reads_the_engines()

    def watchdog_reads_the_engines(self) -> None:
        """What the watchdog does every tick: each engine's own list of what it holds confirms residency."""
        for t in TENANTS:
            model = self.box.loaded[t]
            self.queue.observe_loads(t, {f"{t}:{model}": self.clock.now() + 300.0} if model else {})

    @rule(which=st.integers(0, 13))
    def client_leaves(self, which: int) -> None:
        waiting = [c for c in self.clients if c.outcome is None and c.task is not None]
        if waiting:
            c = waiting[which % len(waiting)]
            assert c.task is not None
            c.task.cancel()
            self.run(until_all_wait())

    @rule(tenant=st.sampled_from(TENANTS), fault=st.sampled_from(["slow", "partial", "hang"]))
    def next_release_fails(self, tenant: str, fault: str) -> None:
        self.box.faults[tenant] = fault

    @rule(gib=st.sampled_from([0, 2, 6]))
    def memory_outside_the_proxy(self, gib: int) -> None:
        """A process the proxy does not manage takes (or gives back) memory: no event tells the queue."""
        self.box.outside = gib * GIB
        for c in self.clients:
            if c.admitted_at is None and c.outcome is None:
                c.outside_seen = min(c.outside_seen, self.box.outside)

    # -- invariants ----------------------------------------------------------------------------
    def check_liveness(self, final: bool = False) -> None:
        now = self.clock.now()
        for c in self.clients:
            assert c.outcome != "timeout", (f"request {c.id} ({c.tenant}:{c.model}) waited {QUEUE_TIMEOUT_S:g} s: a wait "
                                            f"nothing ended; waiting now: {self.queue.waiting()}")
            if final:
                assert c.outcome is not None, f"request {c.id} ({c.tenant}:{c.model}) never ended; {self.queue.waiting()}"
            elif c.admitted_at is None and c.outcome is None:
                assert now - c.arrived < QUEUE_TIMEOUT_S, f"request {c.id} waits past the bound"

    @invariant()
    def every_request_is_admitted_or_refused_within_the_bound(self) -> None:
        self.check_liveness()

    @invariant()
    def nothing_unsafe_happened(self) -> None:
        assert not self.box.violations, self.box.violations

    @invariant()
    def a_waiting_request_is_never_work(self) -> None:
        for c in self.clients:
            if c.outcome is None and c.admitted_at is None and c.work is not None:
                assert not self.inflight.admitted(c.work), f"request {c.id} counts as work while it waits"

    @invariant()
    def no_waiter_is_overtaken_beyond_the_bound(self) -> None:
        for w in self.queue.waiting():
            assert w["overtaken"] <= OVERTAKE_LIMIT, f"waiter {w['id']} ({w['tenant']}) overtaken {w['overtaken']} times"


class SchedulerModelWithSwapHold(SchedulerModel):
    """The same, with swaps away from a tenant active lately held up to 1 s, as shipped: the hold must not cost liveness."""
    SWAP_HOLD_S = 1.0  # as shipped


MODEL_SETTINGS = settings(
    max_examples=int(os.environ.get("HYPERSWAP_MODEL_EXAMPLES", "60")),
    stateful_step_count=40,
    derandomize="HYPERSWAP_MODEL_EXAMPLES" not in os.environ,  # CI: the same examples every run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SchedulerModel.TestCase.settings = MODEL_SETTINGS
SchedulerModelWithSwapHold.TestCase.settings = MODEL_SETTINGS
test_scheduler_model = SchedulerModel.TestCase
test_scheduler_model_with_swap_hold = SchedulerModelWithSwapHold.TestCase


# -- shrunk failures, kept as regular tests ---------------------------------------------------------

def test_a_resident_request_joins_the_reservation_of_the_load_it_rides_on() -> None:
    """Found by a long run: a prompt admitted because the same checkpoint was on its way (resident)
    kept no reservation of its own; when the prompt that loads it left, the memory went back to the
    free pool while the load was still coming, and a chat was admitted on top of it (28.5 GiB on a
    24 GiB card)."""
    m = SchedulerModel()
    try:
        m.arrive(tenant="comfyui", pick=0, service_s=0.2, fails=False)  # loads flux (12.5 GiB): reserved
        m.arrive(tenant="comfyui", pick=0, service_s=0.2, fails=False)  # flux on its way: resident, rides on it
        m.client_leaves(which=0)  # the first prompt's client leaves during the load
        m.arrive(tenant="ollama", pick=0, service_s=0.2, fails=False)  # gemma (16 GiB) does not fit beside flux
        m.nothing_unsafe_happened()
    finally:
        m.teardown()
    assert [c.outcome for c in m.clients] == ["left", "run", "run"]


def test_a_release_under_way_never_shrinks_the_reservation_of_its_own_load() -> None:
    """Found by a long run (2,000 examples): a chat's plan released ComfyUI (slow) while 2 GiB outside
    the proxy filled the card; that memory went, a second chat for the same model then fitted and was
    admitted with a 16 GiB reservation; the release's smaller claim for the same load (9 GiB) replaced
    that reservation in the next pass, and a transcription was admitted on top (26.5 GiB on 24)."""
    m = SchedulerModel()
    try:
        m.next_release_fails(fault="slow", tenant="comfyui")
        m.arrive(tenant="comfyui", pick=1, service_s=0.2, fails=False)  # sdxl, idle by the next step
        m.time_passes(dt=10.0)
        m.memory_outside_the_proxy(gib=2)
        m.arrive(tenant="ollama", pick=0, service_s=0.2, fails=False)  # gemma: release comfyui (slow)
        m.memory_outside_the_proxy(gib=0)
        m.arrive(tenant="ollama", pick=0, service_s=0.2, fails=False)  # gemma fits now: admitted, reserved
        m.arrive(tenant="stt", pick=0, service_s=0.2, fails=False)  # whisper must wait for the release
        m.time_passes(dt=2.0)
        m.nothing_unsafe_happened()
    finally:
        m.teardown()


def test_a_render_on_a_resident_checkpoint_is_planned_on_its_peak_beside_a_chat_model_that_just_loaded() -> None:
    """Issue 40: a render whose checkpoint was on the card was admitted at once, with no plan; its
    sampling memory (1.5 GiB) was never counted, and beside a chat model that had just loaded next to
    the idle checkpoint (23.5 of 23.7 GiB) it ran out of memory. Planned on its peak it releases the
    idle chat model first."""
    m = SchedulerModel()
    try:
        m.arrive(tenant="comfyui", pick=1, service_s=0.2, fails=False)  # sdxl (7 GiB) loads and renders
        m.time_passes(dt=2.5)
        m.arrive(tenant="ollama", pick=0, service_s=0.2, fails=False)  # gemma (16 GiB) fits beside idle sdxl
        m.time_passes(dt=2.5)
        m.arrive(tenant="comfyui", pick=1, service_s=0.2, fails=False)  # sdxl resident: its sampling must fit
        m.time_passes(dt=0.15)
        m.nothing_unsafe_happened()
    finally:
        m.teardown()
    assert [c.outcome for c in m.clients] == ["run", "run", "run"]
