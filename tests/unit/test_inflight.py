"""In-flight accounting and the job poller, on a fake clock."""

from __future__ import annotations

import asyncio

from proxy.clock import FakeClock
from proxy.handoff.inflight import InFlight, JobFate, JobPoller


async def settle() -> None:
    """Let the poller run its fake-clock loop a few rounds."""
    for _ in range(50):  # each fake sleep yields once
        await asyncio.sleep(0)


async def test_poller_restarts_for_a_job_tracked_after_it_stopped() -> None:
    # Admission re-queues an OOM'd prompt after the poller ran out of jobs: it must be polled too,
    # or the tenant stays busy forever.
    inflight = InFlight(FakeClock())
    finished: set[str] = set()
    checked: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        checked.extend(jobs)
        return {j: "done" if j in finished else "running" for j in jobs}

    poller = JobPoller(inflight, "comfyui", check, interval_s=1.0)
    inflight.track_job("comfyui", "first")
    finished.add("first")
    await settle()
    assert inflight.jobs("comfyui") == () and checked == ["first"]

    inflight.track_job("comfyui", "requeued")  # nobody calls ensure_running
    await settle()
    assert checked.count("requeued") >= 1, "a job tracked by anyone must be polled"
    finished.add("requeued")
    await settle()
    assert inflight.jobs("comfyui") == ()
    await poller.stop()


async def test_stopped_poller_ignores_later_jobs_and_other_tenants() -> None:
    inflight = InFlight(FakeClock())
    checked: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        checked.extend(jobs)
        return {}

    poller = JobPoller(inflight, "comfyui", check)
    inflight.track_job("other", "x")
    await settle()
    assert checked == [], "another tenant's job is not this poller's"
    await poller.stop()
    inflight.track_job("comfyui", "late")
    await settle()
    assert checked == [], "a stopped poller (shutdown) must not start again"


def test_tracking_outside_an_event_loop_does_not_raise() -> None:
    inflight = InFlight(FakeClock())
    JobPoller(inflight, "comfyui", lambda jobs: asyncio.sleep(0, result={}))
    assert inflight.track_job("comfyui", "p1")


async def test_a_job_the_engine_no_longer_has_ends_and_is_reported_once() -> None:
    inflight = InFlight(FakeClock())
    lost: list[str] = []

    async def check(jobs: tuple[str, ...]) -> dict[str, JobFate]:
        return {j: "lost" if j == "deleted" else "running" for j in jobs}

    poller = JobPoller(inflight, "comfyui", check, on_lost=lost.append)
    inflight.track_job("comfyui", "deleted")
    inflight.track_job("comfyui", "queued")
    await settle()
    assert inflight.jobs("comfyui") == ("queued",) and lost == ["deleted"]
    await poller.stop()
