"""The GPU's own settings, read: power limit, clocks, clock offsets, fans, persistence mode,
temperature and why the clocks are held down, one view per device index.

Every field is a measured value or None, and a None always has its reason in `unavailable`
("not supported by this card or driver", "no permission", ...): unknown is never shown as 0.
A failure that costs the whole card (driver gone, GPU lost) raises `GpuReadError` like the memory
reader does; a failure of one call costs that field only.

Blocking (C calls): callers run `read_settings()` off the event loop. Writing lives in
`proxy.gpu.settings_writer`, behind its one choke point.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, Protocol

from proxy.gpu.nvml import map_error
from proxy.gpu.snapshot import GpuReadError

SettingsSourceKind = Literal["nvml", "simulated"]
FanPolicy = Literal["auto", "manual"]

NOT_SUPPORTED = "not supported by this card or driver"
NO_PERMISSION = "no permission to read it (NVML answered Insufficient Permissions): run the proxy as root to see it"
# NVML can set locked clocks but has no call that reads them back.
LOCKED_CLOCKS_UNREADABLE = "NVML has no call that reads locked clocks back (it can only set and reset them)"
ZERO_REPORTED = "the driver reports 0: not set or not applicable on this card"
NOT_LOCKED = "not locked: the driver picks the clocks"  # a reader that can see locked clocks, and none are set

# nvmlClocksEventReason* bits (the same bits as the older nvmlClocksThrottleReason*), by the names shown.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),  # application or locked clocks hold the clock down
    (0x4, "sw_power_cap"),  # the power limit
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# Fatal for the whole read: the card or the driver is gone, so no field can be trusted.
_FATAL = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_GpuIsLost", "NVMLError_LibraryNotFound",
          "NVMLError_LibRmVersionMismatch", "NVMLLibraryMismatchError")
_UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")


def decode_reasons(mask: int) -> tuple[str, ...]:
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"other_0x{mask & ~known:x}")
    return tuple(names)


@dataclass(frozen=True, slots=True)
class FanState:
    index: int
    speed_percent: int | None  # the driver's fan speed: 0 is a real reading (fans stopped at idle)
    policy: FanPolicy | None


@dataclass(frozen=True, slots=True)
class GpuSettings:
    """One device's settings as read. None: not read; `unavailable[field]` says why. Its JSON (in
    /api/gpu, through `proxy.gpu.keeper.DeviceReport`) is its fields, in this order."""

    index: int
    name: str
    source: SettingsSourceKind
    read_at: float  # unix seconds
    power_limit_w: float | None = None
    power_limit_default_w: float | None = None
    power_limit_range_w: tuple[float, float] | None = None
    enforced_power_limit_w: float | None = None
    power_draw_w: float | None = None
    graphics_clock_mhz: int | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    max_graphics_clock_mhz: int | None = None
    max_memory_clock_mhz: int | None = None
    applications_graphics_clock_mhz: int | None = None
    applications_memory_clock_mhz: int | None = None
    default_applications_graphics_clock_mhz: int | None = None
    default_applications_memory_clock_mhz: int | None = None
    locked_clocks_mhz: tuple[int, int] | None = None
    gpc_clock_offset_mhz: int | None = None
    gpc_clock_offset_range_mhz: tuple[int, int] | None = None
    mem_clock_offset_mhz: int | None = None
    mem_clock_offset_range_mhz: tuple[int, int] | None = None
    fans: tuple[FanState, ...] | None = None  # (): the card reports no fans it controls
    fan_speed_range_percent: tuple[int, int] | None = None  # what a manual speed may be
    persistence_mode: bool | None = None
    temperature_c: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict, hash=False)


class SettingsSource(Protocol):
    """Reads the settings of the cards it can see. Blocking; may raise `GpuReadError`."""

    def device_indices(self) -> list[int]: ...

    def read_settings(self, index: int) -> GpuSettings: ...


class _Fields:
    """Collects one read's values; a failed call becomes None plus its reason."""

    def __init__(self, nvml: ModuleType) -> None:
        self.nvml = nvml
        self.values: dict[str, Any] = {}  # GpuSettings' fields by name, each of its field's type
        self.unavailable: dict[str, str] = {}

    def _is(self, exc: BaseException, names: tuple[str, ...]) -> bool:
        return any(isinstance(c := getattr(self.nvml, n, None), type) and isinstance(exc, c) for n in names)

    def call(self, names: str | tuple[str, ...], fn_name: str, *args: object,
             convert: Callable[[Any], object] = lambda v: v,  # what pynvml returns is untyped
             zero_is_unknown: bool = False) -> object:
        """Call `nvml.<fn_name>(*args)`; on failure mark every field in `names` unavailable and return None.
        `zero_is_unknown`: a 0 from the driver means "not set here" (a power limit, a maximum clock), not a value."""
        fields = (names,) if isinstance(names, str) else names
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            reason = f"this nvidia-ml-py has no {fn_name}: upgrade nvidia-ml-py"
        else:
            try:
                value = convert(fn(*args))
            except Exception as exc:
                if self._is(exc, _FATAL):
                    raise
                if self._is(exc, _UNSUPPORTED):
                    reason = NOT_SUPPORTED
                elif self._is(exc, ("NVMLError_NoPermission",)):
                    reason = NO_PERMISSION
                else:
                    reason = f"NVML {fn_name} failed: {type(exc).__name__}: {exc}"
            else:
                if not (zero_is_unknown and _zero(value)):
                    for f in fields:
                        self.values.setdefault(f, value)
                    return value
                reason = ZERO_REPORTED
        for f in fields:
            self.unavailable.setdefault(f, reason)
        return None

    def set(self, name: str, value: object) -> None:
        self.values[name] = value


def _zero(value: object) -> bool:
    return not any(value) if isinstance(value, tuple) else not value


def _w(milliwatts: int) -> float:
    return round(int(milliwatts) / 1000, 3)


class NvmlSettingsReader:
    """`SettingsSource` over NVML. `nvml` injects a pynvml-like module (tests); by default imported lazily.
    nvmlInit is reference-counted by pynvml, so this shares the library with the memory reader."""

    def __init__(self, *, nvml: ModuleType | None = None, wall: Callable[[], float] | None = None) -> None:
        self._nvml = nvml
        self._initialised = False
        self._wall = wall or time.time

    def _ensure(self) -> ModuleType:
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
            if not self._initialised:
                self._nvml.nvmlInit()
                self._initialised = True
        except Exception as exc:
            raise map_error(exc, self._nvml) from None
        return self._nvml

    def _failed(self, exc: BaseException) -> GpuReadError:
        """A fatal error: start over (nvmlInit again) on the next read."""
        if self._initialised and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._initialised = False
        return map_error(exc, self._nvml)

    def device_indices(self) -> list[int]:
        nvml = self._ensure()
        try:
            return list(range(int(nvml.nvmlDeviceGetCount())))
        except Exception as exc:
            raise self._failed(exc) from None

    def read_settings(self, index: int) -> GpuSettings:
        nvml = self._ensure()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            f = _Fields(nvml)
            self._power(f, nvml, handle)
            self._clocks(f, nvml, handle)
            self._offsets(f, handle)
            self._fans(f, handle)
            f.call("persistence_mode", "nvmlDeviceGetPersistenceMode", handle, convert=lambda v: int(v) == 1)
            f.call("temperature_c", "nvmlDeviceGetTemperature", handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0),
                   convert=int)
            self._reasons(f, handle)
        except Exception as exc:
            raise self._failed(exc) from None
        f.unavailable.setdefault("locked_clocks_mhz", LOCKED_CLOCKS_UNREADABLE)
        return GpuSettings(index=index, name=name, source="nvml", read_at=self._wall(), **f.values,
                           unavailable=dict(f.unavailable))

    @staticmethod
    def _power(f: _Fields, nvml: ModuleType, handle: object) -> None:
        f.call("power_limit_w", "nvmlDeviceGetPowerManagementLimit", handle, convert=_w, zero_is_unknown=True)
        f.call("power_limit_default_w", "nvmlDeviceGetPowerManagementDefaultLimit", handle, convert=_w,
               zero_is_unknown=True)
        f.call("power_limit_range_w", "nvmlDeviceGetPowerManagementLimitConstraints", handle,
               convert=lambda v: (_w(v[0]), _w(v[1])), zero_is_unknown=True)
        f.call("enforced_power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", handle, convert=_w, zero_is_unknown=True)
        f.call("power_draw_w", "nvmlDeviceGetPowerUsage", handle, convert=_w)

    @staticmethod
    def _clocks(f: _Fields, nvml: ModuleType, handle: object) -> None:
        graphics = getattr(nvml, "NVML_CLOCK_GRAPHICS", 0)
        sm = getattr(nvml, "NVML_CLOCK_SM", 1)
        mem = getattr(nvml, "NVML_CLOCK_MEM", 2)
        f.call("graphics_clock_mhz", "nvmlDeviceGetClockInfo", handle, graphics, convert=int)
        f.call("sm_clock_mhz", "nvmlDeviceGetClockInfo", handle, sm, convert=int)
        f.call("memory_clock_mhz", "nvmlDeviceGetClockInfo", handle, mem, convert=int)
        f.call("max_graphics_clock_mhz", "nvmlDeviceGetMaxClockInfo", handle, graphics, convert=int, zero_is_unknown=True)
        f.call("max_memory_clock_mhz", "nvmlDeviceGetMaxClockInfo", handle, mem, convert=int, zero_is_unknown=True)
        f.call("applications_graphics_clock_mhz", "nvmlDeviceGetApplicationsClock", handle, graphics, convert=int,
               zero_is_unknown=True)
        f.call("applications_memory_clock_mhz", "nvmlDeviceGetApplicationsClock", handle, mem, convert=int,
               zero_is_unknown=True)
        f.call("default_applications_graphics_clock_mhz", "nvmlDeviceGetDefaultApplicationsClock", handle, graphics,
               convert=int, zero_is_unknown=True)
        f.call("default_applications_memory_clock_mhz", "nvmlDeviceGetDefaultApplicationsClock", handle, mem,
               convert=int, zero_is_unknown=True)

    @staticmethod
    def _offsets(f: _Fields, handle: object) -> None:
        pair = lambda v: (int(v[0]), int(v[1]))  # noqa: E731
        f.call("gpc_clock_offset_mhz", "nvmlDeviceGetGpcClkVfOffset", handle, convert=int)
        f.call("gpc_clock_offset_range_mhz", "nvmlDeviceGetGpcClkMinMaxVfOffset", handle, convert=pair)
        f.call("mem_clock_offset_mhz", "nvmlDeviceGetMemClkVfOffset", handle, convert=int)
        f.call("mem_clock_offset_range_mhz", "nvmlDeviceGetMemClkMinMaxVfOffset", handle, convert=pair)

    @staticmethod
    def _fans(f: _Fields, handle: object) -> None:
        count = f.call("fans", "nvmlDeviceGetNumFans", handle, convert=int)
        if not isinstance(count, int):
            return
        if count:
            f.call("fan_speed_range_percent", "nvmlDeviceGetMinMaxFanSpeed", handle,
                   convert=lambda v: (int(v[0]), int(v[1])))
        fans: list[FanState] = []
        for i in range(count):
            probe = _Fields(f.nvml)
            speed = probe.call("speed", "nvmlDeviceGetFanSpeed_v2", handle, i, convert=int)
            policy = probe.call("policy", "nvmlDeviceGetFanControlPolicy_v2", handle, i,
                                convert=lambda v: "manual" if int(v) == 1 else "auto")
            for what, reason in probe.unavailable.items():
                f.unavailable.setdefault(f"fans[{i}].{what}", reason)
            fans.append(FanState(i, speed if isinstance(speed, int) else None,
                                 "manual" if policy == "manual" else "auto" if policy == "auto" else None))
        f.set("fans", tuple(fans))

    @staticmethod
    def _reasons(f: _Fields, handle: object) -> None:
        value = f.call("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", handle, convert=decode_reasons)
        if value is None and f.unavailable.get("clock_event_reasons") != NO_PERMISSION:
            # an older driver or pynvml: the same bits under the older name
            del f.unavailable["clock_event_reasons"]
            f.call("clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", handle, convert=decode_reasons)

