"""Reading the GPU's own settings through NVML, against a fake pynvml: no GPU, no driver.

Every field the card or driver cannot give is null with its reason (not supported, no permission),
never 0; a failure of the whole card raises GpuReadError like the memory reader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import TypeAdapter

from proxy.gpu.settings import (
    LOCKED_CLOCKS_UNREADABLE,
    NO_PERMISSION,
    NOT_SUPPORTED,
    ZERO_REPORTED,
    GpuSettings,
    NvmlSettingsReader,
    decode_reasons,
)
from proxy.gpu.snapshot import GpuReadError
from tests.unit.fake_pynvml import FakePynvmlBase


class FakeNvml(FakePynvmlBase):
    """The slice of pynvml the settings reader uses; return shapes as pynvml's (milliwatts, MHz, lists)."""

    def __init__(self) -> None:
        super().__init__()
        self.NVML_CLOCK_GRAPHICS, self.NVML_CLOCK_SM, self.NVML_CLOCK_MEM = 0, 1, 2
        self.NVML_TEMPERATURE_GPU = 0
        self.fail: dict[str, Exception] = {}  # function name -> what it raises
        self.fans = 2
        self.reasons = 0x1 | 0x4
        self.app_clocks = {0: 1800, 2: 10501}
        self.limits = [150_000, 600_000]

    def _check(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._check("nvmlDeviceGetHandleByIndex")
        return f"handle{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA Fake 4090"

    def __getattr__(self, name: str) -> Callable[..., Any]:
        values: dict[str, Callable[..., Any]] = {
            "nvmlDeviceGetPowerManagementLimit": lambda h: 300_000,
            "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: 450_000,
            "nvmlDeviceGetPowerManagementLimitConstraints": lambda h: self.limits,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 300_000,
            "nvmlDeviceGetPowerUsage": lambda h: 31_456,
            "nvmlDeviceGetClockInfo": lambda h, t: {0: 210, 1: 210, 2: 405}[t],
            "nvmlDeviceGetMaxClockInfo": lambda h, t: {0: 3120, 2: 10501}[t],
            "nvmlDeviceGetApplicationsClock": lambda h, t: self.app_clocks[t],
            "nvmlDeviceGetDefaultApplicationsClock": lambda h, t: {0: 1800, 2: 10501}[t],
            "nvmlDeviceGetGpcClkVfOffset": lambda h: 150,
            "nvmlDeviceGetGpcClkMinMaxVfOffset": lambda h: (-1000, 1000),
            "nvmlDeviceGetMemClkVfOffset": lambda h: -200,
            "nvmlDeviceGetMemClkMinMaxVfOffset": lambda h: (-2000, 6000),
            "nvmlDeviceGetNumFans": lambda h: self.fans,
            "nvmlDeviceGetMinMaxFanSpeed": lambda h: [30, 100],
            "nvmlDeviceGetFanSpeed_v2": lambda h, i: 0 if i == 0 else 35,
            "nvmlDeviceGetFanControlPolicy_v2": lambda h, i: 1 if i == 1 else 0,
            "nvmlDeviceGetPersistenceMode": lambda h: 1,
            "nvmlDeviceGetTemperature": lambda h, sensor: 47,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: self.reasons,
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: self.reasons,
        }
        if name not in values or name in self.__dict__.get("missing", ()):
            raise AttributeError(name)
        fn = values[name]

        def call(*args: Any) -> Any:
            self._check(name)
            return fn(*args)
        return call


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


def reader(nvml: FakeNvml) -> NvmlSettingsReader:
    return NvmlSettingsReader(nvml=nvml, wall=lambda: 1_796_000_000.0)


def test_reads_every_setting_in_watts_and_megahertz(nvml: FakeNvml) -> None:
    s = reader(nvml).read_settings(0)
    assert (s.index, s.name, s.source, s.read_at) == (0, "NVIDIA Fake 4090", "nvml", 1_796_000_000.0)
    assert (s.power_limit_w, s.power_limit_default_w, s.power_limit_range_w) == (300.0, 450.0, (150.0, 600.0))
    assert (s.enforced_power_limit_w, s.power_draw_w) == (300.0, 31.456)
    assert (s.graphics_clock_mhz, s.sm_clock_mhz, s.memory_clock_mhz) == (210, 210, 405)
    assert (s.max_graphics_clock_mhz, s.max_memory_clock_mhz) == (3120, 10501)
    assert (s.applications_graphics_clock_mhz, s.default_applications_memory_clock_mhz) == (1800, 10501)
    assert (s.gpc_clock_offset_mhz, s.gpc_clock_offset_range_mhz) == (150, (-1000, 1000))
    assert (s.mem_clock_offset_mhz, s.mem_clock_offset_range_mhz) == (-200, (-2000, 6000))
    assert [(f.index, f.speed_percent, f.policy) for f in s.fans or ()] == [(0, 0, "auto"), (1, 35, "manual")]
    assert s.fan_speed_range_percent == (30, 100)
    assert (s.persistence_mode, s.temperature_c) == (True, 47)
    assert s.clock_event_reasons == ("gpu_idle", "sw_power_cap")


def test_locked_clocks_are_null_with_the_reason_nvml_cannot_read_them(nvml: FakeNvml) -> None:
    s = reader(nvml).read_settings(0)
    assert s.locked_clocks_mhz is None
    assert s.unavailable == {"locked_clocks_mhz": LOCKED_CLOCKS_UNREADABLE}


def test_a_fan_stopped_at_idle_reads_zero_percent_because_the_card_said_so(nvml: FakeNvml) -> None:
    s = reader(nvml).read_settings(0)
    assert s.fans is not None and s.fans[0].speed_percent == 0 and "fans[0].speed" not in s.unavailable


def test_power_management_not_supported_is_null_with_the_reason_never_zero(nvml: FakeNvml) -> None:
    for fn in ("nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetPowerManagementDefaultLimit",
               "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceGetEnforcedPowerLimit"):
        nvml.fail[fn] = nvml.NVMLError_NotSupported("Not Supported")
    s = reader(nvml).read_settings(0)
    assert (s.power_limit_w, s.power_limit_default_w, s.power_limit_range_w, s.enforced_power_limit_w) == (None,) * 4
    assert s.unavailable["power_limit_w"] == NOT_SUPPORTED
    assert s.unavailable["power_limit_range_w"] == NOT_SUPPORTED
    assert s.power_draw_w == 31.456 and s.temperature_c == 47, "one unsupported call costs its own fields only"
    assert TypeAdapter(GpuSettings).dump_python(s, mode="json")["power_limit_w"] is None, "null in JSON, never 0"


def test_no_permission_is_null_with_a_reason_that_says_so(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetGpcClkVfOffset"] = nvml.NVMLError_NoPermission("Insufficient Permissions")
    nvml.fail["nvmlDeviceGetFanControlPolicy_v2"] = nvml.NVMLError_NoPermission("Insufficient Permissions")
    s = reader(nvml).read_settings(0)
    assert s.gpc_clock_offset_mhz is None and s.unavailable["gpc_clock_offset_mhz"] == NO_PERMISSION
    assert "root" in NO_PERMISSION
    assert s.fans is not None and [f.policy for f in s.fans] == [None, None]
    assert s.unavailable["fans[0].policy"] == NO_PERMISSION and [f.speed_percent for f in s.fans] == [0, 35]


def test_application_clocks_unsupported_on_a_geforce_card(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetApplicationsClock"] = nvml.NVMLError_NotSupported("Not Supported")
    s = reader(nvml).read_settings(0)
    assert s.applications_graphics_clock_mhz is None and s.applications_memory_clock_mhz is None
    assert s.unavailable["applications_memory_clock_mhz"] == NOT_SUPPORTED


def test_a_card_without_fans_reports_an_empty_fan_list(nvml: FakeNvml) -> None:
    nvml.fans = 0
    s = reader(nvml).read_settings(0)
    assert s.fans == () and "fans" not in s.unavailable


def test_fan_count_not_supported_makes_fans_null_with_the_reason(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetNumFans"] = nvml.NVMLError_NotSupported("Not Supported")
    s = reader(nvml).read_settings(0)
    assert s.fans is None and s.unavailable["fans"] == NOT_SUPPORTED


def test_an_older_pynvml_without_a_function_says_to_upgrade(nvml: FakeNvml) -> None:
    nvml.__dict__["missing"] = {"nvmlDeviceGetMemClkVfOffset"}
    s = reader(nvml).read_settings(0)
    assert s.mem_clock_offset_mhz is None
    assert "upgrade nvidia-ml-py" in s.unavailable["mem_clock_offset_mhz"]


def test_clock_event_reasons_fall_back_to_the_older_throttle_reasons_call(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetCurrentClocksEventReasons"] = nvml.NVMLError_FunctionNotFound("Function Not Found")
    nvml.reasons = 0x40 | 0x800000
    s = reader(nvml).read_settings(0)
    assert s.clock_event_reasons == ("hw_thermal_slowdown", "other_0x800000")
    assert "clock_event_reasons" not in s.unavailable


def test_decode_reasons_names_each_bit() -> None:
    assert decode_reasons(0) == ()
    assert decode_reasons(0x2 | 0x20) == ("applications_clocks_setting", "sw_thermal_slowdown")


def test_a_lost_gpu_fails_the_whole_read_and_the_next_read_inits_again(nvml: FakeNvml) -> None:
    r = reader(nvml)
    r.read_settings(0)
    nvml.fail["nvmlDeviceGetPowerManagementLimit"] = nvml.NVMLError_GpuIsLost("GPU is lost")
    with pytest.raises(GpuReadError) as info:
        r.read_settings(0)
    assert info.value.state == "gpu_lost" and "reboot" in info.value.fix
    del nvml.fail["nvmlDeviceGetPowerManagementLimit"]
    assert r.read_settings(0).power_limit_w == 300.0
    assert (nvml.init_calls, nvml.shutdown_calls) == (2, 1)


def test_an_unexpected_nvml_error_costs_the_field_and_names_the_call(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetTemperature"] = nvml.NVMLError_Unknown("Unknown Error")
    s = reader(nvml).read_settings(0)
    assert s.temperature_c is None
    assert "nvmlDeviceGetTemperature" in s.unavailable["temperature_c"]


def test_one_view_per_device_index(nvml: FakeNvml) -> None:
    r = reader(nvml)
    assert r.device_indices() == [0, 1]
    assert r.read_settings(1).index == 1


def test_a_missing_library_is_library_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuReadError) as info:
        NvmlSettingsReader().device_indices()
    assert info.value.state == "library_missing"


def test_a_zero_where_zero_means_not_set_is_null_with_the_reason(nvml: FakeNvml) -> None:
    nvml.app_clocks = {0: 0, 2: 0}
    nvml.limits = [0, 0]
    s = reader(nvml).read_settings(0)
    assert (s.applications_graphics_clock_mhz, s.applications_memory_clock_mhz, s.power_limit_range_w) == (None, None, None)
    assert s.unavailable["applications_graphics_clock_mhz"] == ZERO_REPORTED
    assert s.unavailable["power_limit_range_w"] == ZERO_REPORTED
    assert s.fans is not None and s.fans[0].speed_percent == 0, "a fan speed of 0 is a reading, not a gap"
