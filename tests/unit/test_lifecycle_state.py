"""The lifecycle state machine with fakes: one start shared by concurrent requests, failure and
backoff, never stopped while busy, starts and stops as tasks that report back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.lifecycle import Backoff, Lifecycle, LifecycleError, LifecycleReport, Status, TenantLifecycle
from proxy.lifecycle.controller import Exit


class FakeController:
    """Starts and stops when the test says (`gate`), counting calls."""

    kind = "fake"

    def __init__(self) -> None:
        self.running = False
        self.starts = 0
        self.stops = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_start: str | None = None
        self.lines: tuple[str, ...] = ()
        self.ended: asyncio.Future[Exit | None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        self.starts += 1
        await self.gate.wait()
        if self.fail_start:
            self.lines = ("loading model", self.fail_start)
            raise LifecycleError(self.fail_start, fix="check the model path", output=self.lines)
        self.running = True

    async def stop(self) -> None:
        self.stops += 1
        await self.gate.wait()
        self.running = False

    async def status(self) -> Status:
        return "running" if self.running else "stopped"

    def describe(self) -> dict[str, object]:
        return {"kind": self.kind, "running": self.running}

    def output(self) -> tuple[str, ...]:
        return self.lines

    def summary(self) -> str:
        return "fake"

    def output_elsewhere(self) -> tuple[str, str] | None:
        return None

    def exited(self) -> str | None:
        return None

    async def wait_exit(self) -> Exit | None:
        """Returns when the test ends the app (`crash`), like a child's exit."""
        self.ended = asyncio.get_running_loop().create_future()
        return await self.ended

    def crash(self, code: int = -9) -> None:
        self.running = False
        self.ended.set_result(Exit(code, f"exited with code {code}" if code >= 0 else f"killed by signal {-code}"))

    async def clean_up(self) -> list[str]:
        return []

    async def check(self) -> list[str]:
        return []

    async def aclose(self) -> None:
        self.running = False


class Ready:
    """Readiness the test controls: ready at once, or failing, recording the time it was given."""

    def __init__(self) -> None:
        self.given: list[float] = []
        self.fail: str | None = None

    async def __call__(self, timeout_s: float) -> None:
        self.given.append(timeout_s)
        if self.fail:
            raise LifecycleError(self.fail)


def machine(ctl: FakeController | None = None, ready: Ready | None = None, **kwargs: Any) -> tuple[
        TenantLifecycle, FakeController, Ready, ManualClock, list[LifecycleReport]]:
    ctl, ready, clock, reports = ctl or FakeController(), ready or Ready(), ManualClock(), list[LifecycleReport]()
    lc = TenantLifecycle("llama", ctl, ready, start_timeout_s=30.0, clock=clock, backoff=Backoff(1.0, 8.0),
                         on_report=reports.append, **kwargs)
    return lc, ctl, ready, clock, reports


# -- the pure part ---------------------------------------------------------------------------------


def test_backoff_doubles_from_the_first_delay_up_to_its_cap() -> None:
    assert [Backoff(1.0, 8.0).after(n) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert Backoff(1.0, 60.0).after(10_000) == 60.0, "no overflow after many failures"


def test_a_failed_start_backs_off_and_a_success_forgets_the_failures() -> None:
    s = Lifecycle().starting(0.0).start_failed(0.0, "port in use", None, ("bind: address in use",), Backoff(1.0, 8.0))
    assert (s.state, s.failures, s.retry_at, s.output) == ("failed", 1, 1.0, ("bind: address in use",))
    assert "port in use" in (s.start_refused(0.5) or "")
    assert s.start_refused(1.0) is None
    s = s.starting(1.0).start_failed(1.0, "again", None, (), Backoff(1.0, 8.0))
    assert (s.failures, s.retry_at) == (2, 3.0)
    assert s.starting(3.0).started(4.0) == Lifecycle("running", 4.0)


def test_stop_is_refused_while_busy_or_starting() -> None:
    running = Lifecycle("running", 0.0)
    assert "never stopped" in (running.stop_refused(busy=True) or "")
    assert running.stop_refused(busy=False) is None
    assert Lifecycle("starting", 0.0).stop_refused(busy=False) is not None
    assert running.adopted("stopped", 5.0).state == "stopped" and running.adopted("running", 5.0).state == "running"


# -- the owner of the effects ------------------------------------------------------------------------


async def test_concurrent_requests_share_one_start_and_see_it_starting() -> None:
    lc, ctl, ready, _, reports = machine()
    ctl.gate.clear()
    waiters = [asyncio.create_task(lc.ensure_running()) for _ in range(5)]
    await asyncio.sleep(0)
    assert lc.state == "starting"
    ctl.gate.set()
    outcomes = await asyncio.gather(*waiters)
    assert ctl.starts == 1 and len(ready.given) == 1, "five requests, one start, one readiness wait"
    assert all(o is outcomes[0] for o in outcomes), "every caller gets the same outcome"
    assert lc.state == "running" and reports == [outcomes[0]] and outcomes[0].ok
    assert (await lc.ensure_running()).ok and ctl.starts == 1, "running: nothing more is started"


async def test_a_caller_that_goes_away_does_not_cancel_the_shared_start() -> None:
    lc, ctl, _, _, _ = machine()
    ctl.gate.clear()
    first = asyncio.create_task(lc.ensure_running())
    second = asyncio.create_task(lc.ensure_running())
    await asyncio.sleep(0)
    first.cancel()
    ctl.gate.set()
    assert (await second).ok and lc.state == "running"


async def test_the_scheduler_begins_a_start_without_awaiting_it_and_hears_back() -> None:
    lc, ctl, _, _, _ = machine()
    ctl.gate.clear()
    heard: list[LifecycleReport] = []
    future = lc.begin_start(on_done=heard.append)  # a plain call: returns at once
    assert not future.done() and lc.state == "starting" and heard == []
    ctl.gate.set()
    report = await future
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert heard == [report] and report.action == "start" and report.ok


async def test_a_failed_start_reports_the_reason_and_output_then_backs_off() -> None:
    lc, ctl, _, clock, reports = machine()
    ctl.fail_start = "model file not found"
    report = await lc.begin_start()
    assert (report.ok, report.state, report.error, report.output) == (
        False, "failed", "model file not found", ("loading model", "model file not found"))
    assert report.retry_in_s == 1.0 and reports == [report]
    assert ctl.stops == 1, "whatever a failed start launched is stopped"
    with pytest.raises(LifecycleError) as err:
        await lc.ensure_running()
    assert "its last start failed (model file not found)" in err.value.message and ctl.starts == 1, "backing off"
    assert err.value.body()["output"] == ["loading model", "model file not found"]
    view = lc.view()
    assert view["state"] == "failed" and view["failures"] == 1 and view["retry_in_s"] == 1.0
    await clock.advance(1.0)
    ctl.fail_start = None
    assert (await lc.ensure_running()).ok and ctl.starts == 2 and lc.snapshot.failures == 0


async def test_backoff_grows_with_each_failure_and_force_skips_it() -> None:
    lc, ctl, ready, clock, _ = machine()
    ready.fail = "not ready within 30 s"
    assert (await lc.begin_start()).retry_in_s == 1.0
    await clock.advance(1.0)
    assert (await lc.begin_start()).retry_in_s == 2.0
    refused = await lc.begin_start()
    assert refused.refused and not refused.ok and ctl.starts == 2
    assert not (await lc.begin_start(force=True)).ok and ctl.starts == 3, "the admin's start button tries now"


async def test_a_busy_tenant_is_never_stopped() -> None:
    lc, ctl, _, _, reports = machine()
    await lc.ensure_running()
    report = await lc.begin_stop(busy=lambda: True)
    assert report.refused and not report.ok and "busy" in (report.error or "")
    assert ctl.stops == 0 and lc.state == "running" and reports[-1].action == "start", "a refusal runs nothing"
    assert (await lc.begin_stop(busy=lambda: False)).ok
    assert ctl.stops == 1 and lc.state == "stopped" and not ctl.running


async def test_a_starting_tenant_is_not_stopped_and_a_start_during_a_stop_follows_it() -> None:
    lc, ctl, _, _, _ = machine()
    ctl.gate.clear()
    start = lc.begin_start()
    assert (await lc.begin_stop(busy=lambda: False)).refused
    ctl.gate.set()
    await start
    ctl.gate.clear()
    stop = lc.begin_stop(busy=lambda: False)
    assert lc.state == "stopping"
    again = asyncio.create_task(lc.ensure_running())
    await asyncio.sleep(0)
    assert lc.state == "stopping" and ctl.starts == 1, "the start waits for the stop"
    ctl.gate.set()
    assert (await stop).ok and (await again).ok
    assert (ctl.starts, ctl.stops, lc.state) == (2, 1, "running")


async def test_concurrent_stops_share_one_and_a_stopped_tenant_needs_none() -> None:
    lc, ctl, _, _, _ = machine()
    assert (await lc.begin_stop(busy=lambda: False)).ok and ctl.stops == 0
    await lc.ensure_running()
    ctl.gate.clear()
    a, b = lc.begin_stop(busy=lambda: False), lc.begin_stop(busy=lambda: True)
    ctl.gate.set()
    assert (await a) is (await b) and ctl.stops == 1


async def test_readiness_gets_what_is_left_of_the_start_timeout() -> None:
    lc, ctl, ready, clock, _ = machine()

    async def slow_start() -> None:
        await clock.advance(12.0)
        ctl.running = True

    ctl.start = slow_start  # type: ignore[method-assign]
    await lc.ensure_running()
    assert ready.given == [18.0]


async def test_a_failed_stop_leaves_the_state_failed_never_running_and_the_next_request_finds_it() -> None:
    lc, ctl, _, _, _ = machine()
    await lc.ensure_running()

    async def stubborn() -> None:
        ctl.stops += 1

    ctl.stop = stubborn  # type: ignore[method-assign]
    report = await lc.begin_stop(busy=lambda: False)
    assert not report.ok and report.error == "it still runs after the stop", report
    assert lc.state == "failed" and report.state == "failed", "a failed stop must never read as running"
    assert "its stop failed" in (lc.snapshot.error or "") and lc.snapshot.retry_at is None, "no backoff after a stop"
    assert (await lc.ensure_running()).ok and lc.state == "running", "the next request starts it (it runs: probed)"


async def test_adopt_takes_over_what_runs_and_aclose_stops_a_start_under_way() -> None:
    ctl = FakeController()
    ctl.running = True
    lc, _, _, _, _ = machine(ctl)
    assert (await lc.adopt()).state == "running"
    ctl.running = False
    assert (await lc.adopt()).state == "stopped"
    ctl.gate.clear()
    start = lc.begin_start()
    await asyncio.sleep(0)
    await lc.aclose()
    assert start.cancelled() and not ctl.running


# -- supervision -------------------------------------------------------------------------------------


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_crash_while_running_is_noticed_at_once_reported_and_the_next_request_starts_it() -> None:
    lc, ctl, _, clock, reports = machine()
    await lc.ensure_running()
    await clock.advance(90.0)  # a stable run: the first crash after it may start again at once
    await settle()
    ctl.lines = ("serving", "CUDA error: an illegal memory access was encountered")
    ctl.crash(-9)
    await settle()
    assert lc.state == "failed", "the crash is the state at once, not at the next request"
    (exit_report,) = [r for r in reports if r.action == "exit"]
    assert exit_report.exit_code == -9 and "killed by signal 9" in (exit_report.error or "") and not exit_report.ok
    assert exit_report.output[-1].startswith("CUDA error") and exit_report.duration_s == 90.0
    assert ctl.stops == 1, "what the app left (its group, its descendants) is cleaned up"
    assert (await lc.ensure_running()).ok and ctl.starts == 2, "the next request starts it again, no backoff"
    await settle()
    ctl.crash(1)
    await settle()
    assert lc.state == "failed" and lc.snapshot.crashes == 2
    with pytest.raises(LifecycleError) as err:
        await lc.ensure_running()
    assert "it ended" in err.value.message and "next try is allowed in 1.0 s" in err.value.message, \
        "crashes in a row back off like failed starts"
    await clock.advance(1.0)
    assert (await lc.ensure_running()).ok and ctl.starts == 3


async def test_an_exit_with_code_zero_is_exited_not_failed_and_a_stop_is_no_crash() -> None:
    lc, ctl, _, _, reports = machine()
    await lc.ensure_running()
    await settle()
    ctl.crash(0)
    await settle()
    assert lc.state == "exited" and lc.view()["exit_code"] == 0
    await lc.ensure_running()
    await settle()
    assert (await lc.begin_stop(busy=lambda: False)).ok and lc.state == "stopped"
    await settle()
    assert [r.action for r in reports] == ["start", "exit", "start", "stop"], "the proxy's own stop is no exit"


async def test_restart_on_failure_starts_it_again_without_a_request_up_to_its_limit() -> None:
    lc, ctl, _, clock, reports = machine(restart="on-failure", restart_limit=2)
    await lc.ensure_running()
    await settle()
    ctl.crash(-9)
    await settle()
    assert lc.state == "running" and ctl.starts == 2, "restarted at once after the first crash"
    assert [r.restart_in_s for r in reports if r.action == "exit"] == [0.0]
    await settle()
    ctl.crash(-9)
    await settle()
    assert lc.state == "failed" and ctl.starts == 2, "the second crash in a row waits for its backoff"
    await clock.advance(1.0)
    await settle()
    assert lc.state == "running" and ctl.starts == 3
    await settle()
    ctl.crash(-9)
    await settle()
    await clock.advance(60.0)
    await settle()
    assert lc.state == "failed" and ctl.starts == 3, "past restart_limit crashes in a row: a request must start it"
    assert reports[-1].action == "exit" and reports[-1].restart_in_s is None


async def test_a_clean_exit_is_not_restarted_by_on_failure() -> None:
    lc, ctl, _, _, _ = machine(restart="on-failure")
    await lc.ensure_running()
    await settle()
    ctl.crash(0)
    await settle()
    assert lc.state == "exited" and ctl.starts == 1


async def test_a_running_app_that_stops_answering_its_probe_is_failed_after_three_misses() -> None:
    answers: list[str | None] = []

    async def live() -> str | None:
        return answers.pop(0) if answers else None

    lc, _, _, clock, reports = machine(live=live, live_interval_s=5.0)
    await lc.ensure_running()
    answers.extend(["timed out", None, "timed out", "timed out", "connection refused"])
    for _ in range(4):
        await settle()
        await clock.advance(5.0)
        await settle()
        assert lc.state == "running", "a miss, and misses not in a row, are not a failure"
    await clock.advance(5.0)
    await settle()
    assert lc.state == "failed" and "stopped answering (3 probes in a row: connection refused)" in (lc.snapshot.error or "")
    assert reports[-1].action == "exit" and reports[-1].exit_code is None


async def test_a_hung_app_is_ended_by_its_stop_once_declared_failed_and_the_next_request_starts_a_fresh_copy() -> None:
    answers: list[str | None] = ["timed out"] * 3

    async def live() -> str | None:
        return answers.pop(0) if answers else None

    lc, ctl, _, clock, _ = machine(live=live, live_interval_s=5.0)
    await lc.ensure_running()
    for _ in range(3):
        await settle()
        await clock.advance(5.0)
        await settle()
    assert lc.state == "failed" and ctl.stops == 1, "declared failed: ended by its stop path at once"
    assert not ctl.running, "nothing hung is left holding its port"
    assert (await lc.ensure_running()).ok and ctl.starts == 2 and ctl.running, "the next request starts a fresh copy"


async def test_restart_on_failure_retries_a_failing_start_with_its_backoff_up_to_its_limit_and_says_so() -> None:
    lc, ctl, _, clock, reports = machine(restart="on-failure", restart_limit=3)
    await lc.ensure_running()
    await clock.advance(90.0)
    await settle()
    ctl.fail_start = "CUDA out of memory"
    ctl.crash(-9)
    await settle()
    assert ctl.starts == 2 and lc.state == "failed", "the policy's first try starts at once, and fails"
    failed = [r for r in reports if r.action == "start" and not r.ok]
    assert failed[-1].restart_in_s == 1.0, "a failed try of the policy says when it tries again"
    assert "try 2 of 3" in str(lc.view()["restart_status"]), lc.view()["restart_status"]
    assert lc.restart_pending()
    await clock.advance(1.0)
    await settle()
    assert ctl.starts == 3, "tried again after its backoff, not left failed after one try"
    await clock.advance(2.0)
    await settle()
    assert ctl.starts == 4 and lc.state == "failed"
    await clock.advance(60.0)
    await settle()
    assert ctl.starts == 4, "restart_limit tries in a row (the crash's and the failed starts), then it stops trying"
    assert not lc.restart_pending() and "gave up after 3 tries" in str(lc.view()["restart_status"])
    assert [r for r in reports if r.action == "start"][-1].restart_in_s is None
    ctl.fail_start = None
    assert (await lc.ensure_running()).ok and lc.view()["restart_status"] is None, "a request starts it, as said"


async def test_every_change_of_state_is_told_when_it_happens() -> None:
    lc, ctl, _, _, _ = machine()
    told: list[str] = []
    lc.on_state = lambda tenant: told.append(lc.state)
    ctl.gate.clear()
    start = lc.begin_start()
    assert told == ["starting"], "starting is told before the start has run a step"
    ctl.gate.set()
    await start
    stop = lc.begin_stop(busy=lambda: False)
    assert told[-1] == "stopping"
    await stop
    assert told == ["starting", "running", "stopping", "stopped"]


async def test_health_says_the_policy_restarts_it_only_when_it_will() -> None:
    from proxy.admin.health_entry import lifecycle_entries

    lc, ctl, _, _, _ = machine(restart="on-failure", restart_limit=1)
    await lc.ensure_running()
    await settle()
    ctl.crash(0)
    await settle()
    (entry,) = lifecycle_entries("llama", lc, [])
    assert "restarted by its policy" not in (entry.fix or "") and "clean exit" in (entry.fix or ""), entry
    assert "next request to llama starts it" in (entry.impact or ""), entry
    await lc.ensure_running()
    await settle()
    ctl.crash(-9)  # the second end in a row (the clean exit counted): past restart_limit 1
    await settle()
    (entry,) = lifecycle_entries("llama", lc, [])
    assert not lc.restart_pending() and "restarted by its policy" not in (entry.fix or ""), entry
    assert "gave up after 1 tries" in (entry.fix or ""), entry
