"""The handoff scheduler: the pure `schedule()` and the queue that carries it out.

The queue is driven as llama-swap's scheduler is tested: a recording fake of every effect (read the
card, release, reserve, give back) and an injected clock that moves only when told to.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any

import pytest

from proxy.clock import ManualClock, until_all_wait
from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.decisions import Queued, QueueEnded, ReleaseResult
from proxy.handoff.effects import ScriptedEffects, freed_as_expected
from proxy.handoff.hold import HOLD_SHARE, RELOAD_BYTES_PER_S, SwapHold
from proxy.handoff.inflight import InFlight, Token
from proxy.handoff.orders import Released, ReleaseOrder, release_whole
from proxy.handoff.plan import Plan, Release, TenantState
from proxy.handoff.policy import Releasing, Waiter, queue_order, schedule
from proxy.handoff.reservations import Reservations
from proxy.handoff.scheduler import Admitted, Scheduler
from tests.unit.cards import STT, busy, idle, registry, snap

# -- the pure decision --------------------------------------------------------------------------

_ids = itertools.count(1)


def waiter(tenant: str, need_gib: float, *, at: float = 0.0, priority: int | None = None, key: str | None = None) -> Waiter:
    prio = {"ollama": 50, "comfyui": 40, "stt": 45}[tenant] if priority is None else priority
    return Waiter(next(_ids), tenant, key or f"{tenant}:m", int(need_gib * GIB), prio, at)


def actions(verdicts: tuple[Any, ...]) -> list[tuple[str, str]]:
    return [(v.waiter.tenant, v.action) for v in verdicts]


def test_queue_order_is_priority_then_arrival_and_an_aged_waiter_goes_first() -> None:
    low, high, high_later = waiter("comfyui", 1, at=0), waiter("ollama", 1, at=5), waiter("ollama", 1, at=6)
    assert queue_order([high_later, low, high], now=10, starvation_after_s=60) == [high, high_later, low]
    assert queue_order([high_later, low, high], now=60, starvation_after_s=60) == [low, high, high_later], \
        "after 60 s the low-priority waiter goes ahead of everyone who arrived after it"


def test_busy_holder_makes_the_request_wait_and_idle_holder_is_released() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    w = waiter("ollama", 16)
    (v,) = schedule(s, registry(), busy(idle("ollama"), "comfyui", "1 running job(s)"), [w], {}, 0, 60)
    assert v.action == "wait" and v.plan.wait_for == ("comfyui",) and "queued behind comfyui (1 running job(s))" == v.reason
    (v,) = schedule(s, registry(), idle("ollama", "comfyui"), [w], {}, 0, 60)
    assert v.action == "run" and [r.tenant for r in v.plan.releases] == ["comfyui"]


def test_impossible_need_is_refused_at_once_even_behind_busy_tenants() -> None:
    s = snap([("comfyui", 2, 7 * GIB), ("unmanaged", 9, 6 * GIB)], free=8 * GIB)
    (v,) = schedule(s, registry(), busy(idle(), "comfyui"), [waiter("ollama", 16)], {}, 0, 60)
    assert v.action == "refuse" and "unmanaged" in v.reason


def test_work_of_the_tenant_a_waiter_waits_for_queues_behind_it() -> None:
    # ollama (50) waits for a busy comfyui; a new comfyui prompt would fit, but running it would keep
    # comfyui busy for ever and overtake the higher-priority waiter
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat, prompt = waiter("ollama", 16, at=0), waiter("comfyui", 7, at=1)
    verdicts = schedule(s, registry(), busy(idle(), "comfyui"), [prompt, chat], {}, 2, 60)
    assert actions(verdicts) == [("ollama", "wait"), ("comfyui", "wait")]
    assert verdicts[1].behind == chat.id and "waits for comfyui to finish" in verdicts[1].reason


def test_higher_priority_request_that_fits_runs_past_a_lower_waiter_until_that_one_has_aged() -> None:
    # comfyui (40) waits for a busy ollama; ollama's own next chat fits and outranks it...
    s = snap([("ollama", 1, 16 * GIB)], free=7 * GIB)
    prompt = waiter("comfyui", 10, at=0)
    chat = waiter("ollama", 16, at=10)
    states = busy(idle(), "ollama")
    assert actions(schedule(s, registry(), states, [prompt, chat], {}, 11, 60)) == [("ollama", "run"), ("comfyui", "wait")]
    # ...but once the prompt has waited 60 s, ollama starts nothing new until the prompt has had its turn
    later = waiter("ollama", 16, at=70)
    assert actions(schedule(s, registry(), states, [prompt, later], {}, 71, 60)) == [("comfyui", "wait"), ("ollama", "wait")]


def test_same_load_joins_one_handoff_and_another_load_waits_for_the_next_pass() -> None:
    reg = registry({"stt": STT})
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    a, b, other = waiter("ollama", 16, at=0), waiter("ollama", 16, at=1), waiter("stt", 3, at=2)
    verdicts = schedule(s, reg, idle("ollama", "comfyui", "stt"), [a, b, other], {}, 3, 60)
    assert actions(verdicts) == [("ollama", "run"), ("ollama", "run"), ("stt", "wait")]
    assert verdicts[2].behind == a.id


def test_memory_promised_or_counted_on_ahead_is_not_taken_by_later_waiters() -> None:
    s = snap([], free=10 * GIB)
    reg = registry({"stt": STT})
    # 8 GiB promised to an admitted load still on its way: 3 GiB do not fit
    (v,) = schedule(s, reg, idle(), [waiter("stt", 3)], {"ollama:m": ("ollama", 8 * GIB)}, 0, 60)
    assert v.action == "wait" and v.reason == "queued until loads already admitted reach the card"
    # two waiters that each fit alone but not together: the first in order runs, the second waits
    verdicts = schedule(s, reg, idle(), [waiter("stt", 6, at=1), waiter("ollama", 6, at=2)], {}, 3, 60)
    assert actions(verdicts) == [("ollama", "run"), ("stt", "wait")]


# -- the queue, with a recording fake of its effects ---------------------------------------------------

class Recorder(ScriptedEffects):
    """The shipped fake of the effects over a card the test edits: `procs` and `free`; a release frees
    its tenant down to its floor at once, unless the tenant is in `busy_at_release`."""

    def __init__(self, registry: Registry, clock: ManualClock, procs: list[tuple[str, int, int | None]], free: int) -> None:
        super().__init__(registry, clock, card=self.card_now, release=self.free_at_once,
                         busy=lambda tenant: tenant in self.busy_at_release)
        self.procs = procs
        self.free = free
        self.busy_at_release: set[str] = set()  # tenants that have work again when their turn comes
        self.inflight = LoggedTraffic(clock, self.log)  # the traffic: what makes a tenant busy (admitted work, its jobs)
        self._work: dict[str, Token] = {}

    def set_states(self, states: dict[str, TenantState]) -> None:
        """Make the traffic say what `states` say: a busy tenant whose reason names a job runs a
        relayed job (busy while it holds VRAM above its floor), any other busy one has a request in
        flight; the rest have none."""
        for name in ("ollama", "comfyui", "stt"):
            want = states.get(name)
            busy = want is not None and want.busy
            job = busy and want is not None and "job" in want.busy_reason
            if job and not self.inflight.jobs(name):
                self.inflight.track_job(name, f"{name}-job")
            elif not job and self.inflight.jobs(name):
                self.inflight.finish_job(name, f"{name}-job")
            if busy and not job and name not in self._work:
                self._work[name] = self.inflight.begin(name)
            elif not (busy and not job) and name in self._work:
                self.inflight.end(self._work.pop(name))

    states = property(fset=set_states)

    def card_now(self) -> AttributedSnapshot:
        return snap(self.procs, free=self.free)

    async def free_at_once(self, release: Release) -> ReleaseResult:
        self.free += release.expected_free_bytes
        floor = self.registry.get(release.tenant).idle_vram_bytes
        self.procs = [(t, pid, floor if t == release.tenant else used) for t, pid, used in self.procs]
        return await freed_as_expected(release)


class LoggedReservations(Reservations):
    """The scheduler's promises, each written to the recorder's log too."""

    def __init__(self, log: list[tuple[object, ...]]) -> None:
        super().__init__()
        self.log = log

    def reserve(self, key: str, plan: Plan) -> None:
        self.log.append(("reserve", key))
        super().reserve(key, plan)


class LoggedTraffic(InFlight):
    """The traffic; while `logging`, each admission is written to the recorder's log too."""

    def __init__(self, clock: ManualClock, log: list[tuple[object, ...]]) -> None:
        super().__init__(clock)
        self.log = log
        self.logging = False

    def admit(self, token: Token) -> None:
        if self.logging:
            self.log.append(("work", token.tenant, token.serial))
        super().admit(token)


def scheduler(effects: Recorder) -> Scheduler:
    """The scheduler over the recorder, with its promises and admissions written to the log too."""
    queue = Scheduler(effects, effects.inflight)
    queue.reservations = LoggedReservations(effects.log)
    effects.inflight.logging = True
    return queue


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start=100.0)


def recorder(clock: ManualClock, **proxy: Any) -> Recorder:
    """The box with proxy settings `proxy`; the swap hold off unless asked for (its tests ask)."""
    reg = registry({"stt": STT}, proxy={"queue_timeout_s": 30.0, "swap_hold_s": 0.0, **proxy})
    return Recorder(reg, clock, [("comfyui", 2, 7 * GIB)], free=10 * GIB)


async def test_a_waiter_is_admitted_the_moment_its_blocker_goes_idle_without_polling(clock: ManualClock) -> None:
    effects = recorder(clock)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    assert not chat.done() and effects.log == [("read",)]
    (w,) = queue.waiting()
    assert w["waiting_for"] == ["comfyui"] and w["reason"] == "queued behind comfyui (1 running job(s))"
    (queued,) = [e for e in effects.decisions.events() if isinstance(e, Queued)]
    assert queued.plan.wait_for == ("comfyui",) and effects.decisions.recent()[-1].outcome["waiting_for"] == ["comfyui"]

    effects.states = idle("comfyui")  # the prompt's end marker passed through
    queue.kick()
    admitted = await asyncio.wait_for(chat, 1)

    assert admitted.outcome == "run" and clock.now() == 100.0, "woken by the event, not by a timer"
    assert effects.log == [("read",), ("read",), ("release", ("comfyui",)), ("reserve", "ollama:gemma")]
    assert admitted.handoff.decision is not None
    (ended,) = [e for e in effects.decisions.events() if isinstance(e, QueueEnded)]
    assert ended.refers_to == queued.id and ended.result == "admitted" and ended.ended_by == admitted.handoff.decision.id
    assert not queue.waiting() and ended.waited_s == 0.0
    view = effects.decisions.view(queued.id)
    assert view is not None and view.outcome["result"] == "admitted", "the queued entry shows how its wait ended"
    assert view.outcome["ended_by"] == admitted.handoff.decision.id and view.outcome["waited_s"] == 0.0


async def test_the_wait_ends_with_a_timeout_naming_what_it_waited_for(clock: ManualClock) -> None:
    effects = recorder(clock)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    await clock.advance(29.0)  # the queue's replan sleeps wake, one second apart, along the way
    assert not chat.done(), "still inside proxy.queue_timeout_s"
    await clock.advance(1.0)
    admitted: Admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "timeout" and admitted.handoff.waited_s == 30.0
    assert "queued behind comfyui" in admitted.reason and admitted.handoff.plan.wait_for == ("comfyui",)
    assert ("reserve", "ollama:gemma") not in effects.log and not any(e[0] == "release" for e in effects.log)
    assert effects.decisions.recent()[-1].outcome["result"] == "timed out (503)"
    assert [e.result for e in effects.decisions.events() if isinstance(e, QueueEnded)] == ["timed out (503)"]


async def test_a_client_leaving_the_queue_takes_nothing_and_lets_the_next_one_run(clock: ManualClock) -> None:
    effects = recorder(clock)
    effects.procs = [("comfyui", 2, 7 * GIB)]
    effects.free = 4 * GIB
    effects.states = busy(idle(), "comfyui")
    queue = scheduler(effects)
    first = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:big", 9 * GIB, "request"))
    await until_all_wait()
    second = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 3 * GIB, "request"))
    await until_all_wait()
    assert [w["tenant"] for w in queue.waiting()] == ["ollama", "stt"]
    assert not second.done(), "stt's 3 GiB would fit, but ollama ahead counts on that memory"

    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    admitted = await asyncio.wait_for(second, 1)
    assert admitted.outcome == "run" and effects.log[-1] == ("reserve", "stt:m")
    assert ("reserve", "ollama:big") not in effects.log
    left = [d for d in effects.decisions.recent() if d.kind == "queued" and d.tenant == "ollama"]
    assert left[-1].outcome["result"] == "client left while waiting"


async def test_an_impossible_need_is_refused_at_once_and_logged(clock: ManualClock) -> None:
    effects = recorder(clock)
    queue = scheduler(effects)
    admitted = await asyncio.wait_for(queue.request(effects.registry.get("ollama"), "ollama:huge", 40 * GIB, "request"), 1)
    assert admitted.outcome == "refuse" and "too large for this card" in admitted.reason
    assert effects.decisions.recent()[-1].kind == "rejection" and effects.log == [("read",)]


async def test_concurrent_requests_for_one_load_share_one_release(clock: ManualClock) -> None:
    effects = recorder(clock)
    queue = scheduler(effects)
    ollama = effects.registry.get("ollama")
    results = await asyncio.wait_for(asyncio.gather(
        *(queue.request(ollama, "ollama:gemma", 16 * GIB, "request") for _ in range(3))), 1)
    assert [a.outcome for a in results] == ["run"] * 3
    assert [e for e in effects.log if e[0] == "release"] == [("release", ("comfyui",))]
    assert [e for e in effects.log if e[0] == "reserve"] == [("reserve", "ollama:gemma")] * 3


async def test_a_lower_priority_waiter_gets_its_turn_after_starvation_after_s(clock: ManualClock) -> None:
    effects = recorder(clock, starvation_after_s=10.0, queue_timeout_s=100.0)
    effects.procs = [("ollama", 1, 16 * GIB)]
    effects.free = 7 * GIB
    effects.states = busy(idle(), "ollama", "1 GPU request(s) in flight")
    queue = scheduler(effects)
    ollama, comfy = effects.registry.get("ollama"), effects.registry.get("comfyui")
    prompt = asyncio.ensure_future(queue.request(comfy, "comfyui", 10 * GIB, "request"))
    await until_all_wait()
    chat = await asyncio.wait_for(queue.request(ollama, "ollama:m", 16 * GIB, "request"), 1)
    assert chat.outcome == "run", "a higher-priority request that fits overtakes a young waiter"
    await clock.advance(10.0)
    late_chat = asyncio.ensure_future(queue.request(ollama, "ollama:m", 16 * GIB, "request"))
    await until_all_wait()
    assert not late_chat.done(), "once the prompt has waited 10 s, ollama starts nothing new ahead of it"
    assert queue.waiting()[1]["behind"] == queue.waiting()[0]["id"]
    effects.states = idle("ollama")  # ollama's last generation ends
    queue.kick()
    assert (await asyncio.wait_for(prompt, 1)).outcome == "run"
    assert [e for e in effects.log if e[0] == "release"] == [("release", ("ollama",))]
    await queue.aclose()
    late_chat.cancel()


async def test_the_next_models_files_are_warmed_before_the_release_runs_not_after(clock: ManualClock) -> None:
    effects = recorder(clock)
    queue = scheduler(effects)
    admitted = await asyncio.wait_for(queue.request(effects.registry.get("ollama"), "ollama:gemma3:27b", 16 * GIB,
                                                    "request", model="gemma3:27b"), 1)
    assert admitted.outcome == "run"
    assert effects.log[1:] == [("prepare_load", "ollama", "gemma3:27b"), ("release", ("comfyui",)),
                          ("reserve", "ollama:gemma3:27b")], "the disk read must overlap the release"


async def test_a_load_waiting_for_a_busy_tenant_warms_its_files_while_it_waits(clock: ManualClock) -> None:
    effects = recorder(clock)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request",
                                               model="gemma"))
    await until_all_wait()
    assert not chat.done() and effects.log == [("read",), ("prepare_load", "ollama", "gemma")]
    effects.states = idle()
    queue.kick()
    await asyncio.wait_for(chat, 1)
    assert effects.log.count(("prepare_load", "ollama", "gemma")) == 2, "asked once while waiting, once before releasing"


async def test_a_load_that_names_no_model_warms_nothing(clock: ManualClock) -> None:
    effects = recorder(clock)
    queue = scheduler(effects)
    await asyncio.wait_for(queue.request(effects.registry.get("ollama"), "ollama", 16 * GIB, "request"), 1)
    assert not any(e[0] == "prepare_load" for e in effects.log)


# -- the queue never awaits an effect ---------------------------------------------------------------

class GatedRecorder(Recorder):
    """A recorder whose releases hold until `gate` opens: a release that takes its time on the card."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()

    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        self.log.append(("release started", tuple(r.tenant for r in order.releases)))
        await self.gate.wait()
        return await super().carry_out(order, fresh)


def gated(clock: ManualClock) -> GatedRecorder:
    reg = registry({"stt": STT}, proxy={"queue_timeout_s": 30.0})
    # ollama holds its model (16 GiB) on the card; comfyui idle with 5 GiB; 1 GiB free
    return GatedRecorder(reg, clock, [("ollama", 1, 16 * GIB), ("comfyui", 2, 5 * GIB)], free=1 * GIB)


async def test_a_request_for_a_resident_model_is_admitted_during_another_tenants_release(clock: ManualClock) -> None:
    effects = gated(clock)
    queue = scheduler(effects)
    stt = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 4 * GIB, "request"))
    await until_all_wait()
    assert ("release started", ("comfyui",)) in effects.log and not stt.done()
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    assert chat.done(), "a chat for a model already on the card waited for comfyui's release to end"
    assert chat.result().outcome == "run" and not stt.done()
    effects.gate.set()
    admitted = await asyncio.wait_for(stt, 1)
    assert admitted.outcome == "run" and [r.tenant for r in admitted.handoff.releases] == ["comfyui"]
    await queue.aclose()


async def test_an_admin_release_wakes_a_waiter_at_once(clock: ManualClock) -> None:
    effects = recorder(clock)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    assert not chat.done()
    effects.states = idle("comfyui")  # its prompt ended, but nothing told the queue (no kick)
    order = release_whole(snap(effects.procs, free=effects.free), effects.registry.get("comfyui"), "admin", "release", "admin")
    released = await asyncio.wait_for(queue.release(order), 1)
    assert released.ok
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run" and admitted.handoff.releases == [], "the admin's release freed the memory"
    assert clock.now() == 100.0, "woken by the release's end, not by the replan timer"


async def test_new_work_of_a_tenant_being_released_waits_for_the_release_to_end(clock: ManualClock) -> None:
    effects = gated(clock)
    queue = scheduler(effects)
    stt = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 4 * GIB, "request"))
    await until_all_wait()
    prompt = asyncio.ensure_future(queue.request(effects.registry.get("comfyui"), "comfyui", 1 * GIB, "request"))
    await until_all_wait()
    assert not prompt.done(), "a prompt would load comfyui's models again under its own release"
    (mine,) = [w for w in queue.waiting() if w["tenant"] == "comfyui"]
    assert mine["reason"] == "queued behind the release of comfyui in progress"
    (theirs,) = [w for w in queue.waiting() if w["tenant"] == "stt"]
    assert theirs["reason"] == "releasing comfyui for it" and mine["behind"] == theirs["id"]
    effects.gate.set()
    assert (await asyncio.wait_for(stt, 1)).outcome == "run"
    assert (await asyncio.wait_for(prompt, 1)).outcome == "run"
    assert [e for e in effects.log if e[0] == "release"] == [("release", ("comfyui",))]


async def test_one_release_at_a_time_the_same_load_joins_it_another_waits(clock: ManualClock) -> None:
    effects = gated(clock)
    effects.procs = [("ollama", 1, 10 * GIB), ("comfyui", 2, 5 * GIB)]
    queue = scheduler(effects)
    first = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 4 * GIB, "request"))
    await until_all_wait()
    second = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 4 * GIB, "request"))
    other = asyncio.ensure_future(queue.request(effects.registry.get("comfyui"), "comfyui:x", 12 * GIB, "request"))
    await until_all_wait()
    assert [e for e in effects.log if e[0] == "release started"] == [("release started", ("comfyui",))]
    assert not (first.done() or second.done() or other.done())
    effects.gate.set()
    a, b = await asyncio.wait_for(asyncio.gather(first, second), 1)
    assert a.handoff.decision is b.handoff.decision, "the same load shares one handoff"
    await queue.aclose()
    other.cancel()


async def test_a_release_whose_tenant_had_work_again_admits_nobody_and_plans_again(clock: ManualClock) -> None:
    effects = gated(clock)
    queue = scheduler(effects)
    stt = asyncio.ensure_future(queue.request(effects.registry.get("stt"), "stt:m", 4 * GIB, "request"))
    await until_all_wait()
    effects.states = busy(idle(), "comfyui", "1 GPU request(s) in flight")
    effects.busy_at_release = {"comfyui"}
    effects.gate.set()
    admitted = await asyncio.wait_for(stt, 1)
    assert [r.tenant for r in admitted.handoff.releases] == ["ollama"], \
        "comfyui was not released: the waiter was planned again (idle ollama instead), not run on memory that never came"
    assert [e for e in effects.log if e[0] == "release"] == [("release", ("comfyui",)), ("release", ("ollama",))]


def test_schedule_with_a_release_under_way_runs_what_needs_no_release_and_holds_the_rest() -> None:
    s = snap([("ollama", 1, 16 * GIB), ("comfyui", 2, 5 * GIB)], free=1 * GIB)
    reg = registry({"stt": STT})
    underway = (Releasing(("comfyui",), "stt:m", 99, "stt"),)
    chat, same, other, prompt = (waiter("ollama", 16, at=1), waiter("stt", 4, at=2, key="stt:m"),
                                 waiter("stt", 5, at=3, key="stt:other"), waiter("comfyui", 1, at=4))
    verdicts = schedule(s, reg, idle("ollama", "comfyui", "stt"), [chat, same, other, prompt],
                        {"stt:m": ("stt", 0)}, 5, 60, underway)
    assert actions(verdicts) == [("ollama", "run"), ("stt", "run"), ("stt", "wait"), ("comfyui", "wait")]
    # the chat admitted in this very pass makes ollama busy: the other stt load waits for it to finish
    # rather than plan a release of a tenant that has work now
    assert verdicts[2].plan.wait_for == ("ollama",), verdicts[2].reason
    assert verdicts[3].reason == "queued behind the release of comfyui in progress"
    idle_release = (Releasing(("comfyui",)),)  # the watchdog's: no load waits for that memory
    verdicts = schedule(s, reg, idle("ollama", "comfyui", "stt"), [prompt, other], {}, 5, 60, idle_release)
    assert actions(verdicts) == [("stt", "wait"), ("comfyui", "run")], "an idle release holds back none of its work"
    assert verdicts[0].reason == "queued behind the release of comfyui in progress"


# -- a waiting request is not work; what is on the card goes first, within a bound (issue 32) -------

def test_a_resident_request_runs_ahead_of_a_swap_away_from_its_tenant_and_names_whom_it_overtook() -> None:
    # a chat waits for comfyui's running prompt to end so comfyui can be released; another prompt for
    # the checkpoint comfyui already holds needs nothing: it runs now (one swap for the whole burst)
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat = waiter("ollama", 16, at=0)
    prompt = replace(waiter("comfyui", 7, at=1), resident=True)
    verdicts = schedule(s, registry(), busy(idle(), "comfyui"), [prompt, chat], {}, 2, 60)
    assert actions(verdicts) == [("ollama", "wait"), ("comfyui", "run")], [v.reason for v in verdicts]
    assert verdicts[1].overtook == (chat.id,) and verdicts[1].reason == "resident"


@pytest.mark.parametrize("overtaken, now, why", [(4, 2, "overtaken overtake_limit times"),
                                                 (0, 61, "waited starvation_after_s")])
def test_past_the_fairness_bound_a_resident_request_queues_behind_the_swap(overtaken: int, now: float, why: str) -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat = replace(waiter("ollama", 16, at=0), overtaken=overtaken)
    prompt = replace(waiter("comfyui", 7, at=1), resident=True)
    verdicts = schedule(s, registry(), busy(idle(), "comfyui"), [prompt, chat], {}, now, 60, overtake_limit=4)
    assert actions(verdicts) == [("ollama", "wait"), ("comfyui", "wait")], f"the chat {why}: it is not overtaken again"
    assert verdicts[1].behind == chat.id and "waits for comfyui to finish" in verdicts[1].reason


def test_a_resident_request_waits_when_the_same_pass_starts_releasing_its_tenant() -> None:
    # comfyui went idle: the chat's swap starts in this pass; a prompt would load comfyui under it
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat = waiter("ollama", 16, at=0)
    prompt = replace(waiter("comfyui", 7, at=1), resident=True)
    verdicts = schedule(s, registry(), idle("ollama", "comfyui"), [prompt, chat], {}, 2, 60)
    assert actions(verdicts) == [("ollama", "run"), ("comfyui", "wait")]
    assert verdicts[1].reason == "queued behind the release of comfyui in progress" and verdicts[1].behind == chat.id


# -- holding a swap briefly (proxy.swap_hold_s): what is on the card may be asked for again --------

HOLD = SwapHold(1.0, frozenset({"comfyui"}))  # comfyui's work ran lately


def test_a_swap_away_from_a_tenant_active_lately_is_held_then_started_after_the_hold() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat = waiter("ollama", 16, at=0)
    (v,) = schedule(s, registry(), idle("ollama", "comfyui"), [chat], {}, 0.2, 60, hold=HOLD)
    assert v.action == "wait" and v.held == ("comfyui",), "the swap started inside the hold"
    assert v.plan.feasible and [r.tenant for r in v.plan.releases] == ["comfyui"]
    (release,) = v.plan.releases
    hold = HOLD_SHARE * release.expected_free_bytes / RELOAD_BYTES_PER_S  # a share of its reload at 2 GB/s
    assert 0.2 < hold < 1.0 and v.held_until == pytest.approx(hold), "the hold is not weighed by the reload it risks"
    assert v.reason == (f"holding the swap of comfyui for {hold:.2g} s (proxy.swap_hold_s, weighed by its reload): "
                        "requests for what is on the card go first")
    (v,) = schedule(s, registry(), idle("ollama", "comfyui"), [chat], {}, hold, 60, hold=HOLD)
    assert v.action == "run" and not v.held, "the swap did not start at the hold's end"


@pytest.mark.parametrize("released_gib, expected_s", [(0.5, 0.5 * GIB * HOLD_SHARE / RELOAD_BYTES_PER_S), (30, 1.0)])
def test_the_hold_is_weighed_by_the_reload_it_risks_and_capped_by_swap_hold_s(released_gib: float,
                                                                               expected_s: float) -> None:
    # a small model reloads in a fraction of a second: holding for it gains little; a big one is capped
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    (v,) = schedule(s, registry(), idle("ollama", "comfyui"), [waiter("ollama", 16, at=0)], {}, 0.01, 60, hold=HOLD)
    (release,) = v.plan.releases
    plan = replace(v.plan, releases=(replace(release, expected_free_bytes=int(released_gib * GIB)),))
    assert HOLD.hold_s(plan.releases) == pytest.approx(expected_s)
    assert SwapHold(0.5, frozenset({"stt"})).hold_s(plan.releases) == 0, "held though comfyui was not active lately"


def test_resident_work_overtakes_a_held_swap_counted_and_within_the_bound() -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    chat = waiter("ollama", 16, at=0)
    prompt = replace(waiter("comfyui", 7, at=0.15), resident=True)
    other = waiter("comfyui", 12, at=0.2, key="comfyui:other")  # a checkpoint not on the card
    verdicts = schedule(s, registry(), idle("ollama", "comfyui"), [chat, prompt, other], {}, 0.2, 60, hold=HOLD,
                        overtake_limit=4)
    assert actions(verdicts) == [("ollama", "wait"), ("comfyui", "run"), ("comfyui", "wait")], \
        [v.reason for v in verdicts]
    assert verdicts[1].overtook == (chat.id,), "the overtaking of a held swap was not counted"
    assert verdicts[2].behind == chat.id, "work for a load not on the card ran ahead of the held swap"
    spent = replace(chat, overtaken=4)
    verdicts = schedule(s, registry(), idle("ollama", "comfyui"), [spent, prompt], {}, 0.2, 60, hold=HOLD,
                        overtake_limit=4)
    assert actions(verdicts) == [("ollama", "run"), ("comfyui", "wait")], \
        "past overtake_limit the swap is no longer held and resident work queues behind it"


@pytest.mark.parametrize("hold, why", [(SwapHold(0.5, frozenset({"ollama"})), "comfyui was not active lately"),
                                       (SwapHold(), "the hold is off")])
def test_a_swap_is_not_held_when_its_victim_was_not_active_lately_or_the_hold_is_off(hold: SwapHold, why: str) -> None:
    s = snap([("comfyui", 2, 7 * GIB)], free=10 * GIB)
    (v,) = schedule(s, registry(), idle("ollama", "comfyui"), [waiter("ollama", 16, at=0)], {}, 0.1, 60, hold=hold)
    assert v.action == "run" and not v.held, why
    assert registry().config.proxy.swap_hold_s == 1.0, "swap_hold_s is not 1 s by default"


async def test_the_driver_starts_a_held_swap_at_the_hold_end_and_resident_work_runs_meanwhile(
        clock: ManualClock) -> None:
    effects = recorder(clock, swap_hold_s=0.5)
    queue = scheduler(effects)
    queue.loaded("comfyui", "comfyui:sdxl")
    render = effects.inflight.begin("comfyui")  # comfyui served a render just now
    effects.inflight.end(render)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    (w,) = queue.waiting()
    assert not chat.done() and "holding the swap of comfyui" in w["reason"]
    assert w["waiting_for"] == ["comfyui"], "a held swap waits for the tenant it would release"
    (queued,) = [e for e in effects.decisions.events() if isinstance(e, Queued)]
    assert queued.facts()["waiting_for"] == ["comfyui"], "the dashboard would read 'waited in the queue'"
    await clock.advance(0.2)
    again = queue.admit_at_once(effects.registry.get("comfyui"), "comfyui:sdxl", 7 * GIB)
    assert again is not None and again.reason == "resident", "a render of the checkpoint on the card waited"
    assert queue.waiting()[0]["overtaken"] == 1
    assert ("release", ("comfyui",)) not in effects.log and not chat.done()
    until = clock.now() + queue.next_pause()  # the driver's next pass: the held swap's end
    assert 100.2 < until <= 100.5, "the hold is not a share of comfyui's reload, at most 0.5 s"
    await clock.advance(until - clock.now())
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run" and clock.now() == pytest.approx(until), "not started at the hold's end"
    assert ("release", ("comfyui",)) in effects.log
    await queue.aclose()


async def test_with_the_shipped_hold_a_request_that_waited_longer_than_it_is_not_held_again(
        clock: ManualClock) -> None:
    # the hold counts from the request's arrival: a chat that waited 2 s for a render to end starts
    # its swap the moment the render ends, not 0.5 s later
    effects = recorder(clock, swap_hold_s=0.5)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()
    await clock.advance(2.0)
    assert not chat.done()
    effects.states = idle("comfyui")
    queue.kick()
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run" and clock.now() == pytest.approx(102.0), "held again after waiting for the render"
    await queue.aclose()


async def test_a_request_counts_as_work_only_from_its_admission(clock: ManualClock) -> None:
    # the deadlock of issue 32: a render waiting in the queue counted as comfyui's work, so the chat
    # that waited for comfyui to finish waited for the render, which waited behind the chat
    effects = recorder(clock)
    inflight = effects.inflight
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    chat_work = inflight.begin("ollama", admitted=False)
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request",
                                               work=chat_work))
    render_work = inflight.begin("comfyui", admitted=False)
    render = asyncio.ensure_future(queue.request(effects.registry.get("comfyui"), "comfyui:other", 12 * GIB, "request",
                                                 work=render_work))
    await until_all_wait()
    assert not chat.done() and not render.done()
    assert inflight.traffic("comfyui").in_flight == 0 and not inflight.busy("ollama"), \
        "a waiting request counted as its tenant's work"
    effects.states = idle("comfyui")  # the running prompt ended
    queue.kick()
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run" and ("work", "ollama", chat_work.serial) in effects.log
    assert not render.done() and ("work", "comfyui", render_work.serial) not in effects.log, \
        "the render still waits (for the chat it queued behind), and is still no one's work"
    await queue.aclose()


async def test_admit_at_once_lets_resident_work_past_a_waiting_swap_up_to_the_bound(clock: ManualClock) -> None:
    effects = recorder(clock, overtake_limit=2)
    effects.states = busy(idle(), "comfyui", "1 running job(s)")
    queue = scheduler(effects)
    queue.loaded("comfyui", "comfyui:sdxl")
    comfy = effects.registry.get("comfyui")
    chat = asyncio.ensure_future(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"))
    await until_all_wait()  # planned: it waits for comfyui
    first = queue.admit_at_once(comfy, "comfyui:sdxl", 7 * GIB)
    second = queue.admit_at_once(comfy, "comfyui:sdxl", 7 * GIB)
    assert first is not None and second is not None and first.reason == second.reason == "resident"
    assert queue.admit_at_once(comfy, "comfyui:sdxl", 7 * GIB) is None, \
        "the chat was overtaken overtake_limit (2) times: the third prompt goes through the queue, behind it"
    assert queue.admit_at_once(comfy, "comfyui:other", 7 * GIB) is None, "a load not on the card is planned"
    (waiting,) = queue.waiting()
    assert waiting["tenant"] == "ollama" and not chat.done()
    await queue.aclose()


async def test_a_card_read_that_raises_fails_the_waiters_instead_of_leaving_them_hanging(clock: ManualClock) -> None:
    class Broken(Recorder):
        async def read_card(self) -> AttributedSnapshot:
            raise RuntimeError("reader bug")

    reg = registry({"stt": STT}, proxy={"queue_timeout_s": 30.0})
    effects = Broken(reg, clock, [("comfyui", 2, 7 * GIB)], free=10 * GIB)
    queue = scheduler(effects)
    with pytest.raises(RuntimeError, match="reader bug"):
        await asyncio.wait_for(queue.request(effects.registry.get("ollama"), "ollama:gemma", 16 * GIB, "request"), 1)
    await queue.aclose()


async def test_while_a_render_waits_for_ollama_no_more_chats_are_admitted_than_ollama_runs_at_once(
        clock: ManualClock) -> None:
    """Issue 40 item 6: with a render waiting for Ollama, chats for its resident model were admitted as
    they came and queued inside Ollama (151 ahead of the render); now Ollama gets one at a time, so
    the proxy's queue, with its fairness bound, decides who goes next."""
    effects = recorder(clock, overtake_limit=2)
    effects.procs = [("ollama", 1, 16 * GIB), ("comfyui", 2, 1 * GIB)]
    effects.free = 6 * GIB
    queue = Scheduler(effects, effects.inflight, runs_at_once=lambda tenant: 1)
    ollama, comfy = effects.registry.get("ollama"), effects.registry.get("comfyui")
    queue.loaded("ollama", "ollama:gemma")
    first = effects.inflight.begin("ollama", admitted=False)
    assert queue.admit_at_once(ollama, "ollama:gemma", 16 * GIB, first) is None, "no card read yet"
    running = await asyncio.wait_for(queue.request(ollama, "ollama:gemma", 16 * GIB, "chat", work=first), 1)
    assert running.outcome == "run"
    render = asyncio.ensure_future(queue.request(comfy, "comfyui:flux", 13 * GIB, "render"))
    await until_all_wait()
    assert not render.done(), "the render waits for the chat in flight"
    chats = [effects.inflight.begin("ollama", admitted=False) for _ in range(4)]
    assert all(queue.admit_at_once(ollama, "ollama:gemma", 16 * GIB, w) is None for w in chats), \
        "Ollama runs one chat at a time and one runs: the next ones queue in the proxy, not in Ollama"
    waiting = [asyncio.ensure_future(queue.request(ollama, "ollama:gemma", 16 * GIB, f"chat {i}", work=w))
               for i, w in enumerate(chats)]
    await until_all_wait()
    assert not any(w.done() for w in waiting), [w.result().reason for w in waiting if w.done()]
    admitted_order: list[str] = []
    active = first
    for _ in range(3):
        effects.inflight.end(active)  # the chat in flight ends: one more may go ahead of the render
        await until_all_wait()
        done = [i for i, w in enumerate(waiting) if w.done() and f"chat {i}" not in admitted_order]
        if render.done():
            admitted_order.append("render")
            break
        assert len(done) == 1, f"exactly one chat admitted at a time, got {done}"
        admitted_order.append(f"chat {done[0]}")
        active = chats[done[0]]
    assert admitted_order == ["chat 0", "chat 1", "render"], \
        f"overtake_limit 2: two chats go ahead of the waiting render, then the render runs ({admitted_order})"
    for w in waiting:
        w.cancel()
    await queue.aclose()


async def test_a_load_is_planned_on_the_most_the_card_showed_it_take_while_its_work_ran(clock: ManualClock) -> None:
    """Issue 40 item 3: flux renders were planned on needs_vram_gb (10 GiB) but take 13.8 GiB while
    sampling; a reading taken while the tenant's work was all of that load teaches its peak."""
    effects = recorder(clock)
    effects.procs, effects.free = [("comfyui", 2, 1 * GIB)], 22 * GIB
    queue = scheduler(effects)
    comfy = effects.registry.get("comfyui")
    work = effects.inflight.begin("comfyui", admitted=False)
    first = await asyncio.wait_for(queue.request(comfy, "comfyui:flux", 10 * GIB, "render", work=work), 1)
    assert first.handoff.plan.need_bytes == 10 * GIB, "planned on the estimate until something is learned"
    effects.procs, effects.free = [("comfyui", 2, int(13.8 * GIB))], int(9.2 * GIB)  # sampling
    queue.observe_card(effects.current_card())
    effects.inflight.end(work)
    queue.settle(first.handoff)
    again = await asyncio.wait_for(queue.request(comfy, "comfyui:flux", 10 * GIB, "render"), 1)
    assert again.handoff.plan.need_bytes == int(13.8 * GIB), "the next flux render is planned on its learned peak"
    other = await asyncio.wait_for(queue.request(comfy, "comfyui:sdxl", 10 * GIB, "render"), 1)
    assert other.handoff.plan.need_bytes == 10 * GIB, "another checkpoint's peak is its own"
    await queue.aclose()


async def _gemma_loaded(queue: Scheduler, effects: Recorder, ollama: Tenant) -> None:
    """A chat that loaded ollama:gemma (16 GiB) through the queue and ended: its promise settled."""
    warm = effects.inflight.begin("ollama", admitted=False)
    first = await asyncio.wait_for(queue.request(ollama, "ollama:gemma", 16 * GIB, "chat", work=warm), 1)
    queue.loaded("ollama", "ollama:gemma")
    effects.inflight.end(warm)
    queue.settle(first.handoff)


async def test_a_chat_right_after_an_unload_waits_until_the_card_shows_the_memory_gone(clock: ManualClock) -> None:
    """Found on the demo (issue 40): an unload answered before Ollama let the memory go; a chat right
    after it was planned on a reading that still showed the model, counted that memory as its own and
    reserved nothing; a render took the memory as it came back, and the chat's reload ran out of it."""
    effects = recorder(clock)
    effects.procs, effects.free = [("ollama", 1, 16 * GIB), ("comfyui", 2, 1 * GIB)], 6 * GIB
    queue = scheduler(effects)
    ollama = effects.registry.get("ollama")
    await _gemma_loaded(queue, effects, ollama)
    unload = effects.inflight.begin("ollama", admitted=False)
    queue.admit_unplanned(unload, "ollama", "ollama:gemma")
    effects.inflight.end(unload)
    chat_work = effects.inflight.begin("ollama", admitted=False)
    assert queue.admit_at_once(ollama, "ollama:gemma", 16 * GIB, chat_work) is None
    chat = asyncio.ensure_future(queue.request(ollama, "ollama:gemma", 16 * GIB, "chat", work=chat_work))
    await until_all_wait()
    assert not chat.done(), "planned on a card that still shows the model being unloaded"
    (entry,) = queue.waiting()
    assert "unload of ollama" in entry["reason"], entry
    effects.procs, effects.free = [("ollama", 1, 0), ("comfyui", 2, 1 * GIB)], 22 * GIB  # the memory is back
    await clock.advance(1.0)  # the next read (REPLAN_S) sees it
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run" and admitted.handoff.reservation is not None, \
        "the reload is promised its 16 GiB, so no render takes them"
    await queue.aclose()


async def test_an_unload_the_last_reading_never_showed_loaded_is_seen_once_the_card_shows_the_tenant_at_its_floor(
        clock: ManualClock) -> None:
    """Found by bench/handoff.py: the load's news came before any reading showed the model, so the
    unload began from a reading with nothing of it on the card, no reading could show the memory
    dropping below that, and the next request waited the release timeout (10 s) every round."""
    effects = recorder(clock)
    effects.procs, effects.free = [("ollama", 1, 0), ("comfyui", 2, 1 * GIB)], 22 * GIB
    queue = scheduler(effects)
    ollama = effects.registry.get("ollama")
    await _gemma_loaded(queue, effects, ollama)
    effects.procs, effects.free = [("ollama", 1, 16 * GIB), ("comfyui", 2, 1 * GIB)], 6 * GIB  # unread yet
    unload = effects.inflight.begin("ollama", admitted=False)
    queue.admit_unplanned(unload, "ollama", "ollama:gemma")
    effects.inflight.end(unload)
    effects.procs, effects.free = [("ollama", 1, 0), ("comfyui", 2, 1 * GIB)], 22 * GIB  # the unload is done
    chat = asyncio.ensure_future(queue.request(ollama, "ollama:gemma", 16 * GIB, "chat"))
    await clock.advance(1.0)  # one replan, far short of the release timeout
    admitted = await asyncio.wait_for(chat, 1)
    assert admitted.outcome == "run", admitted
    assert admitted.handoff.reservation is not None
    assert ollama.release_timeout_s > 2.0, "the chat would have been let through by the timeout otherwise"
    await queue.aclose()
