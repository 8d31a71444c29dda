"""Writing the GPU's settings: the one choke point.

Every change the proxy makes to a card goes through `SettingsWriter.write(index, change)`, and only
the GPU settings keeper calls it, only when `gpu_profile.apply` is true. The NVML implementation is
the only code in the proxy that calls an `nvmlDeviceSet*` function; tests replace the writer with a
recorder, and tests/conftest.py makes the real one raise, so no test can touch a card.

NVML refuses every write without root ("Insufficient Permissions"): that becomes a
`SettingsWriteError` of kind `no_permission` with the fix.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

SettingName = Literal["power_limit_w", "locked_clocks_mhz", "gpc_clock_offset_mhz", "mem_clock_offset_mhz",
                      "fan_policy", "fan_speed_percent"]
WriteErrorKind = Literal["no_permission", "not_supported", "invalid", "gpu_unavailable", "failed"]

ROOT_FIX = ("NVML changes GPU settings only for root: run `hyperswap serve` as root (e.g. a systemd unit without "
            "User=), or set the values by hand with sudo nvidia-smi and leave gpu_profile.apply false")


@dataclass(frozen=True, slots=True)
class SettingChange:
    setting: SettingName
    value: float | int | str | tuple[int, int]
    fan: int | None = None  # fan settings: which fan

    def describe(self) -> str:
        where = f" (fan {self.fan})" if self.fan is not None else ""
        return f"{self.setting} = {self.value}{where}"


class SettingsWriteError(Exception):
    def __init__(self, kind: WriteErrorKind, message: str, fix: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.fix = fix


class SettingsWriter(Protocol):
    """The choke point. Blocking; raises `SettingsWriteError`."""

    def write(self, index: int, change: SettingChange) -> None: ...


class RealWriterBlocked(AssertionError):
    """Raised by the NVML writer under the test suite (tests/conftest.py): a test reached a real card."""


def _is(exc: BaseException, nvml: ModuleType | None, *names: str) -> bool:
    return nvml is not None and any(isinstance(c := getattr(nvml, n, None), type) and isinstance(exc, c) for n in names)


class NvmlSettingsWriter:
    """`SettingsWriter` over NVML. `nvml` injects a pynvml-like module (tests of the call mapping);
    without one the real pynvml is imported, which tests/conftest.py forbids."""

    def __init__(self, *, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml
        self._initialised = False

    @staticmethod
    def _real_nvml() -> ModuleType:
        return importlib.import_module("pynvml")

    def _module(self) -> ModuleType:
        if self._nvml is None:
            self._nvml = self._real_nvml()
        if not self._initialised:
            self._nvml.nvmlInit()
            self._initialised = True
        return self._nvml

    def write(self, index: int, change: SettingChange) -> None:
        nvml: ModuleType | None = None
        try:
            nvml = self._module()
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self._set(nvml, handle, change)
        except RealWriterBlocked:
            raise
        except Exception as exc:
            raise self._error(exc, nvml or self._nvml, index, change) from None

    @staticmethod
    def _set(nvml: ModuleType, handle: object, change: SettingChange) -> None:
        v = change.value
        if change.setting == "power_limit_w":
            assert isinstance(v, (int, float))
            nvml.nvmlDeviceSetPowerManagementLimit(handle, round(v * 1000))  # milliwatts
        elif change.setting == "locked_clocks_mhz":
            assert isinstance(v, tuple)
            nvml.nvmlDeviceSetGpuLockedClocks(handle, v[0], v[1])
        elif change.setting == "gpc_clock_offset_mhz":
            nvml.nvmlDeviceSetGpcClkVfOffset(handle, int(v))  # type: ignore[arg-type]
        elif change.setting == "mem_clock_offset_mhz":
            nvml.nvmlDeviceSetMemClkVfOffset(handle, int(v))  # type: ignore[arg-type]
        elif change.setting == "fan_policy" and v == "auto":
            nvml.nvmlDeviceSetDefaultFanSpeed_v2(handle, change.fan or 0)  # back to the driver's own curve
        elif change.setting == "fan_speed_percent":
            # NVML puts the fan under manual control with this call; the speed floor is checked by the caller
            nvml.nvmlDeviceSetFanSpeed_v2(handle, change.fan or 0, int(v))  # type: ignore[arg-type]
        else:  # pragma: no cover - SettingName is closed
            raise ValueError(f"unknown setting {change.setting!r}")

    def _error(self, exc: BaseException, nvml: ModuleType | None, index: int, change: SettingChange) -> SettingsWriteError:
        what = f"setting {change.describe()} on GPU {index}"
        if _is(exc, nvml, "NVMLError_NoPermission"):
            return SettingsWriteError("no_permission", f"{what}: no permission (NVML answered Insufficient Permissions)",
                                      ROOT_FIX)
        if _is(exc, nvml, "NVMLError_NotSupported", "NVMLError_FunctionNotFound") or isinstance(exc, AttributeError):
            return SettingsWriteError("not_supported", f"{what}: not supported by this card or driver ({exc})",
                                      f"remove {change.setting} from gpu_profile in tenants.json")
        if _is(exc, nvml, "NVMLError_InvalidArgument"):
            return SettingsWriteError("invalid", f"{what}: the driver refused the value ({exc})",
                                      f"choose a value in the card's range for gpu_profile.{change.setting} "
                                      "(GET /api/gpu shows the ranges)")
        if isinstance(exc, ImportError) or _is(exc, nvml, "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                                               "NVMLError_GpuIsLost", "NVMLError_Uninitialized"):
            self._initialised = False
            return SettingsWriteError("gpu_unavailable", f"{what}: the GPU cannot be reached ({type(exc).__name__}: {exc})",
                                      "see the nvml health entry; the profile is applied again once the card answers")
        return SettingsWriteError("failed", f"{what}: {type(exc).__name__}: {exc}", "check `nvidia-smi -q`; see the proxy's log")
