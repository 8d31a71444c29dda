"""In-flight accounting and the job poller, on a fake clock."""

from __future__ import annotations

import asyncio
import itertools

from proxy.clock import ManualClock
from proxy.handoff.inflight import InFlight, JobFate, JobPoller

POLL_S = 1.0


async def test_poller_restarts_for_a_job_tracked_after_it_stopped() -> None:
    # Admission re-queues an OOM'd prompt after the poller ran out of jobs: it must be polled too,
    # or the tenant stays busy forever.
    clock = ManualClock()
    inflight = InFlight(clock)
    finished: set[str] = set()
    checked: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        checked.extend(jobs)
        return {j: "done" if j in finished else "running" for j in jobs}

    poller = JobPoller(inflight, "comfyui", check, interval_s=POLL_S)
    inflight.track_job("comfyui", "first")
    finished.add("first")
    await clock.advance(POLL_S)  # one poll
    assert inflight.jobs("comfyui") == () and checked == ["first"]

    inflight.track_job("comfyui", "requeued")  # nobody calls ensure_running
    await clock.advance(POLL_S)  # one poll
    assert checked.count("requeued") >= 1, "a job tracked by anyone must be polled"
    finished.add("requeued")
    await clock.advance(POLL_S)  # one poll
    assert inflight.jobs("comfyui") == ()
    await poller.stop()


async def test_stopped_poller_ignores_later_jobs_and_other_tenants() -> None:
    clock = ManualClock()
    inflight = InFlight(clock)
    checked: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        checked.extend(jobs)
        return {}

    poller = JobPoller(inflight, "comfyui", check, interval_s=POLL_S)
    inflight.track_job("other", "x")
    await clock.advance(POLL_S)  # one poll
    assert checked == [], "another tenant's job is not this poller's"
    await poller.stop()
    inflight.track_job("comfyui", "late")
    await clock.advance(POLL_S)  # one poll
    assert checked == [], "a stopped poller (shutdown) must not start again"


def test_tracking_outside_an_event_loop_does_not_raise() -> None:
    inflight = InFlight(ManualClock())
    JobPoller(inflight, "comfyui", lambda jobs: asyncio.sleep(0, result={}))
    assert inflight.track_job("comfyui", "p1")


async def test_a_job_the_engine_no_longer_has_ends_and_is_reported_once() -> None:
    clock = ManualClock()
    inflight = InFlight(clock)
    lost: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        return {j: "lost" if j == "deleted" else "running" for j in jobs}

    poller = JobPoller(inflight, "comfyui", check, interval_s=POLL_S, on_lost=lost.append)
    inflight.track_job("comfyui", "deleted")
    inflight.track_job("comfyui", "queued")
    await clock.advance(POLL_S)  # one poll
    assert inflight.jobs("comfyui") == ("queued",) and lost == ["deleted"]
    await poller.stop()


async def test_check_soon_checks_at_once_but_no_faster_than_min_gap() -> None:
    # a client polling /history at 50 Hz asks for a check each time: the engine is asked at most
    # every min_gap_s, and the end is heard within it instead of at the next interval
    clock = ManualClock()
    inflight = InFlight(clock)
    checks: list[float] = []
    done = False

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        checks.append(clock.now())
        return {j: "done" if done else "running" for j in jobs}

    poller = JobPoller(inflight, "comfyui", check, interval_s=POLL_S, min_gap_s=0.1)
    start = clock.now()
    inflight.track_job("comfyui", "p1")
    for _ in range(10):  # 0.2 s of a client polling every 20 ms
        poller.check_soon()
        await clock.advance(0.02)
    assert 1 <= len(checks) <= 3, checks
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(checks)), checks
    done = True
    poller.check_soon()
    await clock.advance(0.1)
    assert inflight.jobs("comfyui") == () and clock.now() - start < POLL_S, "the end waited for the interval"
    await poller.stop()


async def test_bytes_passing_mark_activity_at_most_once_a_second_without_telling_listeners() -> None:
    clock = ManualClock()
    inflight = InFlight(clock)
    heard: list[str] = []
    token = inflight.begin("t")
    inflight.on_change.append(lambda tenant, _: heard.append(tenant))
    start = clock.now()
    await clock.advance(0.5)
    inflight.active("t")
    assert inflight.traffic("t").last_activity == start, "within a second of the last mark: not marked again"
    await clock.advance(0.6)
    inflight.active("t")
    assert inflight.traffic("t").last_activity == start + 1.1
    assert heard == [], "activity alone changes nothing a listener acts on (busy, counts, jobs)"
    inflight.end(token)
    assert inflight.traffic("t").last_activity == start + 1.1 and heard == ["t"]


async def test_a_connection_that_loads_nothing_is_no_activity_and_its_end_is_heard_once_all_are_closed() -> None:
    """A UI poll or a model list (any request on the listener) counts as an open connection, for a
    tenant the proxy would stop, but is no GPU activity: an idle-release deadline or a queue read's
    freshness must not move with it. The last one closing is told to the listeners (the queue may
    stop that tenant now)."""
    clock = ManualClock()
    inflight = InFlight(clock)
    heard: list[tuple[str, int]] = []
    inflight.on_change.append(lambda tenant, traffic: heard.append((tenant, traffic.connections)))
    with inflight.request("ollama"):
        pass
    activity = inflight.traffic("ollama").last_activity
    heard.clear()
    await clock.advance(30)
    with inflight.connection("ollama"), inflight.connection("ollama"), inflight.connection("stt"):
        assert inflight.connections("ollama") == 2 and inflight.traffic("ollama").connections == 2
        assert inflight.snapshot()["stt"].connections == 1, "a tenant with only a stream open is in the snapshot"
    assert inflight.traffic("ollama").last_activity == activity, "a poll that loads nothing moved the idle deadline"
    assert heard == [("stt", 0), ("ollama", 0)], "the listeners hear each tenant's last connection close, once"
