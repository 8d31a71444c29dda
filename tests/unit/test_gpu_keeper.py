"""The GPU settings keeper: drift is logged with its start, nothing is written without
`gpu_profile.apply`, and applying goes through the SettingsWriter choke point only (a recorder
here), with backoff on failure and a re-apply after the card is reset."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.config.settings import GpuProfile
from proxy.gpu.keeper import GpuSettingsKeeper
from proxy.gpu.settings_writer import ROOT_FIX, SettingChange, SettingsWriteError
from proxy.gpu.snapshot import GpuReadError
from proxy.handoff.decisions import DecisionLog
from proxy.sim.gpu_settings import SimulatedCardSettings, SimulatedSettingsSpec


class RecordingWriter:
    """The choke point, replaced: records each write and, unless told to fail, passes it to the simulated card."""

    def __init__(self, card: SimulatedCardSettings) -> None:
        self.card = card
        self.writes: list[tuple[int, SettingChange]] = []
        self.fail: SettingsWriteError | None = None

    def write(self, index: int, change: SettingChange) -> None:
        self.writes.append((index, change))
        if self.fail is not None:
            raise self.fail
        self.card.write(index, change)


class NeverWriter:
    def write(self, index: int, change: SettingChange) -> None:
        raise AssertionError(f"wrote {change} without gpu_profile.apply")


class FlakySource:
    """The simulated card, but reads fail while `down` (a driver reload)."""

    def __init__(self, card: SimulatedCardSettings) -> None:
        self.card = card
        self.down = False

    def device_indices(self) -> list[int]:
        return self.card.device_indices()

    def read_settings(self, index: int) -> Any:
        if self.down:
            raise GpuReadError("driver_not_loaded", "NVIDIA driver not loaded", "load the driver")
        return self.card.read_settings(index)


def make(profile: dict[str, Any], spec: dict[str, Any] | None = None, *, writer: Any = None
         ) -> tuple[GpuSettingsKeeper, SimulatedCardSettings, Any, DecisionLog, ManualClock]:
    card = SimulatedCardSettings(spec=SimulatedSettingsSpec.model_validate(spec or {}))
    clock = ManualClock()
    log = DecisionLog(clock)
    w = writer if writer is not None else RecordingWriter(card)
    keeper = GpuSettingsKeeper(FlakySource(card), w, GpuProfile.model_validate(profile), clock, log)
    return keeper, card, w, log, clock


def source_of(keeper: GpuSettingsKeeper) -> FlakySource:
    """The keeper's settings reader, the flaky one `make` gave it."""
    assert isinstance(keeper.source, FlakySource), keeper.source
    return keeper.source


def kinds(log: DecisionLog) -> list[str]:
    return [d.kind for d in log.recent()]


async def test_drift_without_apply_is_logged_with_its_start_and_nothing_is_written() -> None:
    keeper, card, _, log, clock = make({"power_limit_w": 300}, writer=NeverWriter())
    await keeper.check()
    await clock.advance(120)
    await keeper.check()
    view = keeper.devices[0]
    assert [c.status for c in view.checks] == ["drift"]
    assert view.drift_since == {"power_limit_w": clock.wall() - 120}, "since when: the first check that saw it"
    assert kinds(log) == ["gpu_drift"], "one decision when the drift starts, not one per check"
    assert log.recent()[0].outcome["started"] == ["power_limit_w"]
    assert card.read_settings(0).power_limit_w == 450.0


async def test_drift_ending_is_logged_as_resolved() -> None:
    keeper, card, _, log, _ = make({"power_limit_w": 300}, writer=NeverWriter())
    await keeper.check()
    card.set(power_limit_w=300.0)  # someone ran nvidia-smi -pl 300
    await keeper.check()
    assert kinds(log) == ["gpu_drift", "gpu_drift"] and log.recent()[-1].outcome["resolved"] == ["power_limit_w"]
    assert keeper.devices[0].drift_since == {}


async def test_apply_writes_the_drifting_settings_through_the_writer_and_logs_it() -> None:
    keeper, _card, writer, log, _ = make({"power_limit_w": 300, "fan_policy": "manual", "fan_speed_percent": 55, "apply": True})
    await keeper.check()
    assert [c for _, c in writer.writes] == [SettingChange("power_limit_w", 300.0), SettingChange("fan_speed_percent", 55, fan=0),
                                             SettingChange("fan_speed_percent", 55, fan=1)]
    applied = next(d for d in log.recent() if d.kind == "gpu_apply")
    assert applied.outcome["ok"] is True and "first check" in applied.trigger
    assert [c.status for c in keeper.devices[0].checks] == ["ok", "ok", "ok"]
    await keeper.check()
    assert len(writer.writes) == 3, "nothing more to write once the card matches"


async def test_without_permission_the_error_says_root_and_retries_back_off() -> None:
    keeper, _card, writer, log, clock = make({"power_limit_w": 300, "apply": True})
    writer.fail = SettingsWriteError("no_permission", "no permission (NVML answered Insufficient Permissions)", ROOT_FIX)
    await keeper.check()
    assert keeper.apply_error is not None and keeper.apply_error.kind == "no_permission"
    assert keeper.report().model_dump(mode="json")["apply"]["error"]["fix"] == ROOT_FIX
    assert next(d for d in log.recent() if d.kind == "gpu_apply").outcome["ok"] is False
    await clock.advance(29)
    await keeper.check()
    assert len(writer.writes) == 1, "no retry within the first 30 s"
    await clock.advance(2)
    await keeper.check()
    assert len(writer.writes) == 2
    await clock.advance(59)
    await keeper.check()
    assert len(writer.writes) == 2, "the second wait doubles to 60 s"
    writer.fail = None
    await clock.advance(2)
    await keeper.check()
    assert len(writer.writes) == 3 and keeper.apply_error is None and keeper.apply_failures == 0


async def test_a_value_the_card_ignores_counts_as_a_failed_apply() -> None:
    class Ignoring(RecordingWriter):
        def write(self, index: int, change: SettingChange) -> None:
            self.writes.append((index, change))  # accepted, but the card does not change

    keeper, card, _writer, _, _ = make({"power_limit_w": 300, "apply": True}, writer=None)
    keeper.writer = Ignoring(card)
    await keeper.check()
    assert keeper.apply_error is not None and "still shows power_limit_w" in keeper.apply_error.message


async def test_after_a_driver_reset_the_profile_is_written_again() -> None:
    keeper, card, writer, log, _ = make({"power_limit_w": 300, "locked_clocks_mhz": {"min": 900, "max": 2100}, "apply": True},
                                        {"readable_locked_clocks": False})
    await keeper.check()
    assert [c.setting for _, c in writer.writes] == ["power_limit_w", "locked_clocks_mhz"]
    await keeper.check()
    assert len(writer.writes) == 2, "locked clocks cannot be read back: not rewritten without a reason"
    card.driver_reset()
    await keeper.check()
    assert [c.setting for _, c in writer.writes[2:]] == ["power_limit_w", "locked_clocks_mhz"]
    assert "changed back from the profile" in [d for d in log.recent() if d.kind == "gpu_apply"][-1].trigger


async def test_after_the_card_could_not_be_read_unreadable_settings_are_written_again() -> None:
    keeper, _card, writer, _, _ = make({"locked_clocks_mhz": {"min": 900, "max": 2100}, "apply": True},
                                      {"readable_locked_clocks": False})
    await keeper.check()
    source_of(keeper).down = True
    await keeper.check()
    assert keeper.devices[0].error is not None
    assert keeper.report().devices[0].settings is None, "no stale settings shown for a card that cannot be read"
    source_of(keeper).down = False
    await keeper.check()
    assert [c.setting for _, c in writer.writes] == ["locked_clocks_mhz", "locked_clocks_mhz"]


async def test_unsupported_settings_are_never_written() -> None:
    keeper, _, writer, _, _ = make({"power_limit_w": 300, "fan_policy": "auto", "apply": True},
                                   {"unsupported": ["power_limit_w", "fans"]})
    await keeper.check()
    assert writer.writes == []
    assert [c.status for c in keeper.devices[0].checks] == ["unsupported", "unsupported"]


@pytest.mark.parametrize("apply", [False, True])
async def test_a_card_that_cannot_be_read_is_kept_as_an_error_never_raised(apply: bool) -> None:
    keeper, _, _writer, _, _ = make({"power_limit_w": 300, "apply": apply}, writer=NeverWriter())
    source_of(keeper).down = True
    await keeper.check()
    assert keeper.devices[0].error is not None and keeper.devices[0].settings is None
