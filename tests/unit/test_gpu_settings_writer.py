"""The one choke point that writes GPU settings: its NVML call mapping against a fake pynvml, its
errors, and the guard that keeps every test away from a real card."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.gpu.settings_writer import ROOT_FIX, NvmlSettingsWriter, RealWriterBlocked, SettingChange, SettingsWriteError
from tests.unit.fake_pynvml import FakePynvmlBase


class FakeNvml(FakePynvmlBase):
    """The setters the writer calls, each recorded in order after nvmlInit; `error` makes them raise."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.error: Exception | None = None

    def nvmlInit(self) -> None:
        super().nvmlInit()
        self.calls.append(("init",))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"h{index}"

    def _record(self, *call: Any) -> None:
        if self.error is not None:
            raise self.error
        self.calls.append(call)

    def nvmlDeviceSetPowerManagementLimit(self, h: str, mw: int) -> None:
        self._record("power", h, mw)

    def nvmlDeviceSetGpuLockedClocks(self, h: str, lo: int, hi: int) -> None:
        self._record("locked", h, lo, hi)

    def nvmlDeviceSetGpcClkVfOffset(self, h: str, v: int) -> None:
        self._record("gpc", h, v)

    def nvmlDeviceSetMemClkVfOffset(self, h: str, v: int) -> None:
        self._record("mem", h, v)

    def nvmlDeviceSetDefaultFanSpeed_v2(self, h: str, fan: int) -> None:
        self._record("fan_default", h, fan)

    def nvmlDeviceSetFanSpeed_v2(self, h: str, fan: int, speed: int) -> None:
        self._record("fan_speed", h, fan, speed)


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


def test_no_test_can_reach_the_real_writer() -> None:
    """tests/conftest.py makes the real NVML writer raise: if this fails, a test could change a real card."""
    with pytest.raises(RealWriterBlocked):
        NvmlSettingsWriter().write(0, SettingChange("power_limit_w", 300.0))


@pytest.mark.parametrize(("change", "call"), [
    (SettingChange("power_limit_w", 287.5), ("power", "h1", 287_500)),  # milliwatts
    (SettingChange("locked_clocks_mhz", (1000, 2500)), ("locked", "h1", 1000, 2500)),
    (SettingChange("gpc_clock_offset_mhz", -150), ("gpc", "h1", -150)),
    (SettingChange("mem_clock_offset_mhz", 800), ("mem", "h1", 800)),
    (SettingChange("fan_policy", "auto", fan=1), ("fan_default", "h1", 1)),
    (SettingChange("fan_speed_percent", 60, fan=0), ("fan_speed", "h1", 0, 60)),
])
def test_each_setting_becomes_one_nvml_set_call(nvml: FakeNvml, change: SettingChange, call: tuple[Any, ...]) -> None:
    NvmlSettingsWriter(nvml=nvml).write(1, change)
    assert nvml.calls == [("init",), call]


def test_no_permission_says_root_is_needed(nvml: FakeNvml) -> None:
    nvml.error = nvml.NVMLError_NoPermission("Insufficient Permissions")
    with pytest.raises(SettingsWriteError) as info:
        NvmlSettingsWriter(nvml=nvml).write(0, SettingChange("power_limit_w", 300.0))
    assert info.value.kind == "no_permission" and info.value.fix == ROOT_FIX and "root" in ROOT_FIX
    assert "power_limit_w = 300.0" in info.value.message


@pytest.mark.parametrize(("error", "kind", "fix_word"), [
    ("NVMLError_NotSupported", "not_supported", "remove"),
    ("NVMLError_InvalidArgument", "invalid", "range"),
    ("NVMLError_GpuIsLost", "gpu_unavailable", "nvml health"),
])
def test_driver_refusals_map_to_kinds_with_fixes(nvml: FakeNvml, error: str, kind: str, fix_word: str) -> None:
    nvml.error = getattr(nvml, error)("boom")
    with pytest.raises(SettingsWriteError) as info:
        NvmlSettingsWriter(nvml=nvml).write(0, SettingChange("gpc_clock_offset_mhz", 100))
    assert info.value.kind == kind and fix_word in info.value.fix
