"""Release kind `cuda_suspend` (issue 43): its state machine, host RAM as its budget, the faults
(a process that is not CUDA, a restore that fails, a process that exits while suspended) and the
refusals at the proxy's start (a driver too old, the API absent), with a fake driver seam."""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.schema import ReleaseFailed
from proxy.config.units import GIB
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.hold import HOLD_SHARE, RELOAD_BYTES_PER_S, RESTORE_BYTES_PER_S, SwapHold
from proxy.handoff.plan import plan_release
from proxy.handoff.sleepers import Lifecycles
from proxy.lifecycle import Status
from proxy.lifecycle.cuda_driver import CheckpointError, ProcessState, checkpointer_for
from proxy.lifecycle.cuda_suspend import CudaSuspend
from proxy.lifecycle.state import TenantLifecycle
from proxy.lifecycle.suspend_state import IllegalMove, Suspension
from proxy.lifecycle.suspender import RestoreFailed, Suspensions
from tests.json_reads import decisions_in
from tests.unit.cards import STT, idle, registry, snap


def state_of(suspensions: Suspensions, tenant: str) -> str:
    """The tenant's suspension state (it must have a record)."""
    record = suspensions.record(tenant)
    assert record is not None, f"no suspension record for {tenant}"
    return record.state


class FakeDriver:
    """A driver seam in memory: which pids are parked, what fails next."""

    via = "fake"

    def __init__(self, host_ram: int = 64 * GIB) -> None:
        self.host_ram = host_ram
        self.parked: set[int] = set()
        self.not_cuda: set[int] = set()
        self.gone: set[int] = set()
        self.fail_restore: str | None = None
        self.calls: list[tuple[str, int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def state(self, pid: int) -> ProcessState:
        if pid in self.gone:
            return "gone"
        return "not_cuda" if pid in self.not_cuda else "checkpointed" if pid in self.parked else "running"

    async def suspend(self, pid: int, lock_timeout_s: float) -> None:
        self.calls.append(("suspend", pid))
        await self.gate.wait()
        if pid in self.not_cuda:
            raise CheckpointError(f"process {pid} is not cuda, not a running CUDA process", not_cuda=True)
        self.parked.add(pid)

    async def restore(self, pid: int) -> None:
        self.calls.append(("restore", pid))
        if pid in self.gone:
            raise CheckpointError(f"process {pid} is gone: nothing to restore", gone=True)
        if self.fail_restore:
            raise CheckpointError(self.fail_restore)
        self.parked.discard(pid)

    def host_available_bytes(self) -> int | None:
        return self.host_ram


def tenants(*release: dict[str, Any], **more: Any) -> Any:
    return registry_from_dict({"tenants": {"comfyui": {"release": list(release), **more}}})


def suspensions(driver: FakeDriver, *release: dict[str, Any]) -> tuple[Suspensions, Any]:
    reg = tenants(*(release or ({"kind": "cuda_suspend"}, {"kind": "comfyui_free"})))
    return Suspensions(reg, ManualClock(), driver), reg.get("comfyui")


# -- the state machine -------------------------------------------------------------------------------

def test_the_state_machine_goes_running_suspending_suspended_resuming_running() -> None:
    s = Suspension("comfyui")
    s = s.suspending((41,), 6 * GIB, "fake", 1.0)
    assert s.state == "suspending" and s.dormant and s.parked_bytes == 6 * GIB
    s = s.parked(2.0)
    assert s.state == "suspended" and s.dormant and s.suspends == 1
    s = s.resuming(3.0)
    assert s.state == "resuming" and s.dormant
    s = s.back(3.5)
    assert (s.state, s.dormant, s.parked_bytes, s.pids, s.restores, s.last_restore_s) == ("running", False, 0, (), 1, 0.5)


def test_a_failed_suspend_rolls_back_to_running_and_a_failed_restore_parks_nothing() -> None:
    s = Suspension("comfyui").suspending((41,), GIB, "fake", 1.0).rolled_back("not CUDA", "check match", 2.0)
    assert (s.state, s.parked_bytes, s.error, s.dormant) == ("running", 0, "not CUDA", False)
    s = s.suspending((41,), GIB, "fake", 3.0).parked(4.0).resuming(5.0).failed("restore failed", None, 6.0)
    assert (s.state, s.parked_bytes, s.dormant) == ("failed", 0, False)
    assert s.recovered(7.0).state == "running"


@pytest.mark.parametrize(("move", "state"), [("parked", "running"), ("resuming", "running"), ("back", "suspended")])
def test_a_move_the_state_machine_does_not_have_is_refused(move: str, state: str) -> None:
    s = Suspension("comfyui")
    if state == "suspended":
        s = s.suspending((1,), 1, "fake", 0.0).parked(0.0)
    with pytest.raises(IllegalMove, match=f"no move from {state}"):
        getattr(s, move)(1.0)


# -- the owner: host RAM, faults ---------------------------------------------------------------------

async def test_a_suspend_parks_the_processes_and_a_restore_brings_them_back() -> None:
    driver = FakeDriver()
    owner, tenant = suspensions(driver)
    asked = await owner.suspend(tenant, [(41, 5 * GIB), (42, GIB)])
    assert asked["suspended"] == [41, 42] and asked["parked_bytes"] == 6 * GIB
    assert state_of(owner, "comfyui") == "suspended" and owner.parked_bytes() == 6 * GIB
    assert driver.parked == {41, 42}
    back = await owner.restore("comfyui")
    assert back is not None and back["restored"] == [41, 42] and back["bytes"] == 6 * GIB
    assert state_of(owner, "comfyui") == "running" and owner.parked_bytes() == 0


async def test_a_suspend_that_does_not_fit_in_host_ram_falls_back_and_touches_nothing() -> None:
    driver = FakeDriver(host_ram=8 * GIB)  # 6 GiB to park + 4 GiB margin > 8 GiB available
    owner, tenant = suspensions(driver)
    with pytest.raises(ReleaseFailed, match=r"host RAM short: suspending comfyui parks 6.0 GiB .* 8.0 GiB is available"):
        await owner.suspend(tenant, [(41, 6 * GIB)])
    assert driver.calls == [] and state_of(owner, "comfyui") == "running"


async def test_the_operator_margin_counts_against_host_ram() -> None:
    driver = FakeDriver(host_ram=8 * GIB)
    owner, tenant = suspensions(driver, {"kind": "cuda_suspend", "host_ram_margin_gb": 1})
    await owner.suspend(tenant, [(41, 6 * GIB)])
    assert state_of(owner, "comfyui") == "suspended"


async def test_a_process_that_is_not_cuda_is_refused_and_what_was_suspended_is_restored() -> None:
    driver = FakeDriver()
    driver.not_cuda.add(42)
    owner, tenant = suspensions(driver)
    with pytest.raises(ReleaseFailed, match="not a running CUDA process"):
        await owner.suspend(tenant, [(41, GIB), (42, GIB)])
    rec = owner.record("comfyui")
    assert rec is not None and rec.state == "running" and "no CUDA state" in (rec.error or "")
    assert driver.calls == [("suspend", 41), ("suspend", 42), ("restore", 41)] and driver.parked == set()


async def test_a_restore_that_fails_leaves_the_state_failed_with_the_reason() -> None:
    driver = FakeDriver()
    owner, tenant = suspensions(driver)
    await owner.suspend(tenant, [(41, GIB)])
    driver.fail_restore = "CUDA_ERROR_ILLEGAL_STATE"
    with pytest.raises(RestoreFailed, match="the restore failed: CUDA_ERROR_ILLEGAL_STATE") as info:
        await owner.restore("comfyui")
    assert not info.value.gone
    assert state_of(owner, "comfyui") == "failed" and owner.parked_bytes() == 0


async def test_a_process_that_exits_while_suspended_is_a_failed_restore_that_says_so() -> None:
    driver = FakeDriver()
    owner, tenant = suspensions(driver)
    await owner.suspend(tenant, [(41, GIB)])
    driver.gone.add(41)
    with pytest.raises(RestoreFailed, match="exited while suspended") as info:
        await owner.restore("comfyui")
    assert info.value.gone


async def test_a_restore_asked_during_the_suspend_waits_for_it_then_restores() -> None:
    driver = FakeDriver()
    driver.gate.clear()
    owner, tenant = suspensions(driver)
    suspending = asyncio.create_task(owner.suspend(tenant, [(41, GIB)]))
    await asyncio.sleep(0)
    assert owner.dormant("comfyui") and state_of(owner, "comfyui") == "suspending"
    restoring = asyncio.create_task(owner.restore("comfyui"))
    await asyncio.sleep(0)
    assert not restoring.done()
    driver.gate.set()
    await suspending
    back = await restoring
    assert back is not None and driver.calls == [("suspend", 41), ("restore", 41)]
    assert state_of(owner, "comfyui") == "running"


# -- the fallback to stop and start ----------------------------------------------------------------

class FakeController:
    kind = "fake"

    def __init__(self) -> None:
        self.running = True
        self.starts = 0
        self.stops = 0
        self.ended: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        self.starts += 1
        self.running = True

    async def stop(self) -> None:
        self.stops += 1
        self.running = False

    async def status(self) -> Status:
        return "running" if self.running else "stopped"

    async def wait_exit(self) -> Any:
        return await self.ended

    def output(self) -> tuple[str, ...]:
        return ()

    def describe(self) -> dict[str, Any]:
        return {}


async def test_a_restore_that_fails_falls_back_to_stop_and_start() -> None:
    clock = ManualClock()
    reg = tenants({"kind": "cuda_suspend"}, {"kind": "process", "command": ["/bin/true"]}, upstream="http://127.0.0.1:1")
    tenant = reg.get("comfyui")
    ctl = FakeController()

    async def ready(_timeout_s: float) -> None:
        return None

    machine = TenantLifecycle("comfyui", ctl, ready, start_timeout_s=5, clock=clock)  # type: ignore[arg-type]
    await machine.ensure_running()
    ctl.starts = 0
    driver = FakeDriver()
    decisions = DecisionLog(clock)
    async with httpx.AsyncClient() as client:
        lives = Lifecycles(reg, lambda t: None, clock, decisions, client,  # type: ignore[arg-type,return-value]
                           controllers={"comfyui": machine}, checkpointer=driver)
        await lives.suspend(tenant, [(41, GIB)])
        lives.released(tenant, tenant.release_steps[0])
        assert lives.dormant("comfyui")
        driver.fail_restore = "CUDA_ERROR_UNKNOWN"
        await lives.wake(tenant)
    assert (ctl.stops, ctl.starts) == (1, 1), "the app was stopped and started again"
    assert not lives.dormant("comfyui") and state_of(lives.suspensions, "comfyui") == "running"
    (only,) = decisions_in(decisions, "resume")
    assert only.outcome["ok"] is False and only.outcome["asked"]["fallback"] == "stop and start", only.outcome
    assert "the restore failed: CUDA_ERROR_UNKNOWN; stopped and started it instead" in only.outcome["error"]


# -- refused at the proxy's start, with the fix ----------------------------------------------------

class NoCheckpointApi:
    """A libcuda of driver 565: cuInit is there, cuCheckpointProcess* are not."""

    def cuInit(self, flags: int) -> int:
        return 0


def test_a_driver_without_the_checkpoint_api_is_refused_with_the_fix() -> None:
    """Its version unreadable (a container without sysfs), the library itself says: the API is absent."""
    with pytest.raises(ConfigError) as info:
        checkpointer_for("driver", "cuda-checkpoint", {}, load=lambda _name: NoCheckpointApi(),  # type: ignore[arg-type,return-value]
                         version=None, platform="linux")
    assert "no CUDA checkpoint API" in str(info.value) and "cuCheckpointProcessLock" in str(info.value)
    assert info.value.fix is not None and "570" in info.value.fix and "utility" in info.value.fix


def test_a_driver_of_550_to_569_is_pointed_at_the_utility() -> None:
    with pytest.raises(ConfigError, match=r"needs NVIDIA driver 570 or newer; this machine runs 565\.57\.01") as info:
        checkpointer_for("driver", "cuda-checkpoint", {}, version="565.57.01", platform="linux")
    assert info.value.fix is not None and "utility" in info.value.fix and "550" in info.value.fix


@pytest.mark.parametrize(("via", "needs"), [("driver", "570"), ("utility", "550")])
def test_a_driver_older_than_needed_is_refused_with_the_fix(via: str, needs: str) -> None:
    with pytest.raises(ConfigError, match=rf"needs NVIDIA driver {needs} or newer; this machine runs 535\.183\.01") as info:
        checkpointer_for(via, "cuda-checkpoint", {"PATH": "/nonexistent"}, version="535.183.01",  # type: ignore[arg-type]
                         platform="linux")
    assert info.value.fix is not None and f"update the NVIDIA driver to {needs}+" in info.value.fix


def test_no_libcuda_and_no_utility_and_not_linux_are_each_refused() -> None:
    def missing(_name: str) -> ctypes.CDLL:
        raise OSError("libcuda.so.1: cannot open shared object file")

    with pytest.raises(ConfigError, match=r"libcuda\.so\.1, which does not load"):
        checkpointer_for("driver", "cuda-checkpoint", {}, load=missing, version=None, platform="linux")
    with pytest.raises(ConfigError, match="'cuda-checkpoint' is not found on PATH") as info:
        checkpointer_for("utility", "cuda-checkpoint", {"PATH": "/nonexistent"}, version="550.54.14", platform="linux")
    assert info.value.fix is not None and "NVIDIA/cuda-checkpoint" in info.value.fix
    with pytest.raises(ConfigError, match="needs Linux"):
        checkpointer_for("driver", "cuda-checkpoint", {}, platform="darwin")


def test_a_tenant_with_cuda_suspend_alone_or_in_a_list_loads() -> None:
    alone = registry_from_dict({"tenants": {"comfyui": {"release": {"kind": "cuda_suspend"}}}}).get("comfyui")
    listed = tenants({"kind": "cuda_suspend", "via": "utility", "host_ram_margin_gb": 2}, {"kind": "comfyui_free"})
    for tenant in (alone, listed.get("comfyui")):
        step = tenant.release_steps[0]
        assert isinstance(step, CudaSuspend) and step.suspends and step.resumes and tenant.reclaimable
    assert listed.get("comfyui").release_steps[0].host_ram_margin_bytes == 2 * GIB


async def test_the_proxy_refuses_to_start_when_the_driver_cannot_suspend(monkeypatch: pytest.MonkeyPatch) -> None:
    """No checkpointer handed in (not the demo): the real one is built at start and refused there."""
    reg = tenants({"kind": "cuda_suspend", "via": "utility", "utility": "no-such-cuda-checkpoint"})
    monkeypatch.setattr("proxy.lifecycle.cuda_driver.driver_version", lambda *a: "570.86.10")
    monkeypatch.setattr("proxy.lifecycle.cuda_driver.sys.platform", "linux")
    with pytest.raises(ConfigError, match="'no-such-cuda-checkpoint' is not found on PATH"):
        Suspensions(reg, ManualClock(), None, env={"PATH": "/nonexistent"})


# -- the swap hold weighs the cheaper undo ----------------------------------------------------------

class Rel:
    def __init__(self, tenant: str, nbytes: int) -> None:
        self.tenant, self.expected_free_bytes = tenant, nbytes


def test_a_swap_away_from_a_suspending_tenant_is_held_for_its_restore_not_a_reload() -> None:
    released = [Rel("comfyui", 7 * GIB)]
    reload = SwapHold(1.0, frozenset({"comfyui"}))
    restore = SwapHold(1.0, frozenset({"comfyui"}), restores=frozenset({"comfyui"}))
    assert reload.hold_s(released) == pytest.approx(HOLD_SHARE * 7 * GIB / RELOAD_BYTES_PER_S)
    assert restore.hold_s(released) == pytest.approx(HOLD_SHARE * 7 * GIB / RESTORE_BYTES_PER_S)
    assert restore.hold_s(released) < reload.hold_s(released) / 5, "a restore is undone ~6x faster than a reload"


# -- the planner: at equal priority, the cheaper undo goes first --------------------------------------

def test_at_equal_priority_the_planner_releases_the_tenant_a_restore_undoes_before_one_a_reload_undoes() -> None:
    a = {**STT, "match": {"process_names": [], "cmdline_patterns": ["a --serve"]}, "priority": 40}
    b = {**STT, "match": {"process_names": [], "cmdline_patterns": ["b --serve"]}, "priority": 40}
    card = snap([("a", 11, 8 * GIB), ("b", 12, 6 * GIB)], free=2 * GIB)
    # a holds more: the biggest goes first when both reload
    plan = plan_release(card, registry({"a": a, "b": b}), idle("a", "b"), "comfyui", 7 * GIB)
    assert [r.tenant for r in plan.releases] == ["a"]
    # b parks in host RAM: a restore (~12 GB/s) undoes it ~6x cheaper than a reload, so it goes first
    reg = registry({"a": a, "b": {**b, "release": [{"kind": "cuda_suspend"}, {"kind": "http", "url": "/release"}]}})
    plan = plan_release(card, reg, idle("a", "b"), "comfyui", 7 * GIB)
    assert [r.tenant for r in plan.releases] == ["b"]
