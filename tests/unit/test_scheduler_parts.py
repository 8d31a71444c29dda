"""The scheduler's parts, each on its own: the release line (one release at a time, whoever asked;
the next runs on a fresh card) and the wait list (which tickets a pass plans for, who waits for
whom, who ran out of time, when the driver wakes next)."""

from __future__ import annotations

import asyncio

from proxy.handoff.decisions import HandoffKind
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import Plan, Release
from proxy.handoff.policy import Verdict, Waiter
from proxy.handoff.release_line import ReleaseLine
from proxy.handoff.tickets import Admitted, Ticket, Underway
from proxy.handoff.waitlist import WaitList

GIB = 1 << 30


def plan(requester: str = "ollama", *, wait_for: tuple[str, ...] = (), releases: tuple[Release, ...] = ()) -> Plan:
    return Plan(requester, 4 * GIB, 2 * GIB, 0, not wait_for, False, releases, (), "test plan", False,
                wait_for=wait_for)


def order(*tenants: str, requester: str = "ollama", kind: HandoffKind = "plan") -> ReleaseOrder:
    releases = tuple(Release(t, GIB, (), "test") for t in tenants)
    return ReleaseOrder(requester, releases, "test", kind, plan(requester, releases=releases))


async def test_releases_run_one_at_a_time_and_the_next_reads_the_card_afresh() -> None:
    started: list[tuple[str, bool]] = []
    began = {"comfyui": asyncio.Event(), "stt": asyncio.Event()}
    gates = {"comfyui": asyncio.Event(), "stt": asyncio.Event()}
    ended: list[Underway] = []
    all_ended = asyncio.Event()

    async def carry_out(o: ReleaseOrder, fresh: bool) -> Released:
        name = o.releases[0].tenant
        started.append((name, fresh))
        began[name].set()
        await gates[name].wait()
        return Released(o, [], None)

    def on_done(u: Underway, task: asyncio.Task[Released]) -> None:
        ended.append(u)
        line.finished(u)
        if not line:
            all_ended.set()

    line = ReleaseLine(carry_out, on_done)
    first = line.start(order("comfyui"), "ollama:m", 1)
    second = line.start(order("stt"), None, None)
    await began["comfyui"].wait()
    assert started == [("comfyui", False)], "the second release waits in line, not on a lock"
    assert [s.tenants for s in line.states] == [("comfyui",), ("stt",)]
    assert line.for_load("ollama:m") is first and line.for_load("other") is None
    assert line.promised_away("comfyui") and not line.promised_away("stt"), \
        "only a release that makes room for a load counts on its tenants' memory"
    gates["comfyui"].set()
    await began["stt"].wait()
    assert started[1] == ("stt", True), "the one that waited in line plans on a fresh card"
    assert ended == [first] and [u.state.tenants for u in line] == [("stt",)]
    gates["stt"].set()
    await all_ended.wait()
    assert ended == [first, second]


async def test_a_release_claims_what_its_load_takes_from_free_memory_the_larger_promise_standing() -> None:
    async def carry_out(o: ReleaseOrder, fresh: bool) -> Released:
        await asyncio.Event().wait()
        raise AssertionError("never ends")

    line = ReleaseLine(carry_out, lambda u, t: None)
    line.start(order("comfyui"), "ollama:m", 1)  # needs 4 GiB, 1 GiB expected back: 3 GiB from free memory
    assert line.claims({}) == {"ollama:m": ("ollama", 3 * GIB)}
    assert line.claims({"ollama:m": ("ollama", 5 * GIB)}) == {"ollama:m": ("ollama", 5 * GIB)}
    for task in line.cancel():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def ticket(id_: int, tenant: str, *, at: float = 0.0, verdict_wait_for: tuple[str, ...] | None = None) -> Ticket:
    w = Waiter(id_, tenant, f"{tenant}:m", GIB, 50, at)
    future: asyncio.Future[Admitted] = asyncio.get_running_loop().create_future()
    t = Ticket(w, "test", "plan", future, 0.0)
    if verdict_wait_for is not None:
        t.verdict = Verdict(w, "wait", plan(tenant, wait_for=verdict_wait_for), "queued behind " + ", ".join(verdict_wait_for))
    return t


async def test_who_waits_for_a_tenant_is_unknown_while_a_planned_waiter_has_no_verdict_yet() -> None:
    waits = WaitList()
    waits[1] = ticket(1, "ollama", verdict_wait_for=("comfyui",))
    waits[2] = ticket(2, "stt", verdict_wait_for=("ollama",))
    assert [t.waiter.id for t in waits.waiting_for("comfyui") or []] == [1]
    waits[3] = ticket(3, "stt")
    assert waits.waiting_for("comfyui") is None, "a waiter not planned yet may be one that waits for it"
    line = ReleaseLine(lambda o, fresh: asyncio.sleep(0, Released(o, [], None)), lambda u, t: None)
    waits[3].joined = line.start(order("comfyui"), "stt:m", 3)
    assert [t.waiter.id for t in waits.planned()] == [1, 2], "a waiter on a release under way is not planned again"
    assert waits.joined_to(waits[3].joined) == [waits[3]]
    for task in line.cancel():
        await task


async def test_the_driver_wakes_at_the_first_deadline_and_overdue_waiters_are_the_planned_ones() -> None:
    waits = WaitList()
    waits[1] = ticket(1, "ollama", at=0.0)
    waits[2] = ticket(2, "stt", at=4.0)
    assert waits.next_pause(now=5.0, timeout_s=6.0, starvation_s=60.0, replan_s=1.0) == 1.0, "the replan timer"
    assert waits.next_pause(now=5.5, timeout_s=6.0, starvation_s=60.0, replan_s=1.0) == 0.5, "the first timeout"
    assert [t.waiter.id for t in waits.overdue(now=6.0, timeout_s=6.0)] == [1]
