"""The simulated card's own settings: power limit, clocks, offsets, fans, persistence, temperature.

Both a `SettingsSource` and a `SettingsWriter`, so the demo shows the GPU panel, drift against a
`gpu_profile`, and (with `apply: true`) the profile being written and re-written after
`driver_reset()` puts every setting back to its default. `unsupported` names settings the
simulated card lacks (reads give null with the reason, writes fail as NVML's NotSupported does);
`writes_need_root` makes every write fail as NVML does for a user who is not root.

Thread-safe: the keeper reads and writes from a worker thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.gpu.settings import LOCKED_CLOCKS_UNREADABLE, NOT_LOCKED, NOT_SUPPORTED, FanState, GpuSettings
from proxy.gpu.settings_writer import ROOT_FIX, SettingChange, SettingsWriteError

# What a setting the card lacks takes with it (the fields read alongside it).
FAMILIES: dict[str, tuple[str, ...]] = {
    "power_limit_w": ("power_limit_w", "power_limit_default_w", "power_limit_range_w", "enforced_power_limit_w"),
    "locked_clocks_mhz": ("locked_clocks_mhz",),
    "gpc_clock_offset_mhz": ("gpc_clock_offset_mhz", "gpc_clock_offset_range_mhz"),
    "mem_clock_offset_mhz": ("mem_clock_offset_mhz", "mem_clock_offset_range_mhz"),
    "fans": ("fans", "fan_speed_range_percent"),
}
Unsupportable = Literal["power_limit_w", "locked_clocks_mhz", "gpc_clock_offset_mhz", "mem_clock_offset_mhz", "fans"]


class SimulatedSettingsSpec(BaseModel):
    """A scenario's `gpu.settings`: the card's state at start (defaults: an RTX 4090-like card)."""

    model_config = ConfigDict(extra="forbid")
    power_limit_w: float = 450.0
    power_limit_default_w: float = 450.0
    power_limit_range_w: tuple[float, float] = (150.0, 600.0)
    max_graphics_clock_mhz: int = 3120
    max_memory_clock_mhz: int = 10501
    locked_clocks_mhz: tuple[int, int] | None = None  # None: not locked (the card's default)
    gpc_clock_offset_mhz: int = 0
    gpc_clock_offset_range_mhz: tuple[int, int] = (-1000, 1000)
    mem_clock_offset_mhz: int = 0
    mem_clock_offset_range_mhz: tuple[int, int] = (-2000, 6000)
    fans: int = 2
    fan_speed_percent: int = 30
    fan_speed_range_percent: tuple[int, int] = (30, 100)
    fan_policy: str = "auto"
    persistence_mode: bool = True
    temperature_c: int = 41
    unsupported: list[Unsupportable] = Field(default_factory=list, description="settings this card lacks")
    readable_locked_clocks: bool = True  # false: like NVML, locked clocks cannot be read back
    writes_need_root: bool = False  # true: every write fails with no_permission, as for a non-root NVML user


@dataclass(slots=True)
class _State:
    power_limit_w: float
    locked_clocks_mhz: tuple[int, int] | None
    gpc_clock_offset_mhz: int
    mem_clock_offset_mhz: int
    fan_speeds: list[int]
    fan_policies: list[str]
    persistence_mode: bool


@dataclass(slots=True)
class SimulatedCardSettings:
    name: str = "Simulated RTX 4090"
    spec: SimulatedSettingsSpec = field(default_factory=SimulatedSettingsSpec)
    writes: list[tuple[int, SettingChange]] = field(default_factory=list)  # every write, for tests and the demo
    resets: int = 0
    _state: _State = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._state = self._initial()

    def _initial(self) -> _State:
        s = self.spec
        return _State(s.power_limit_w, s.locked_clocks_mhz, s.gpc_clock_offset_mhz, s.mem_clock_offset_mhz,
                      [s.fan_speed_percent] * s.fans, [s.fan_policy] * s.fans, s.persistence_mode)

    def _defaults(self) -> _State:
        s = self.spec
        return _State(s.power_limit_default_w, None, 0, 0, [s.fan_speed_percent] * s.fans, ["auto"] * s.fans,
                      s.persistence_mode)

    # -- what tests and the demo drive ----------------------------------------------------------
    def driver_reset(self) -> None:
        """The driver re-initialises the card: every setting back to its default."""
        with self._lock:
            self._state = self._defaults()
            self.resets += 1

    def set(self, **changes: Any) -> None:
        """Someone else (nvidia-smi) changes the card: `set(power_limit_w=300)`."""
        with self._lock:
            self._state = replace(self._state, **changes)

    # -- SettingsSource ---------------------------------------------------------------------------
    def device_indices(self) -> list[int]:
        return [0]

    def read_settings(self, index: int) -> GpuSettings:
        spec = self.spec
        with self._lock:
            st = replace(self._state, fan_speeds=list(self._state.fan_speeds), fan_policies=list(self._state.fan_policies))
        unavailable: dict[str, str] = {}
        values: dict[str, Any] = {
            "power_limit_w": st.power_limit_w, "power_limit_default_w": spec.power_limit_default_w,
            "power_limit_range_w": spec.power_limit_range_w, "enforced_power_limit_w": st.power_limit_w,
            "power_draw_w": 31.5, "graphics_clock_mhz": 210, "sm_clock_mhz": 210, "memory_clock_mhz": 405,
            "max_graphics_clock_mhz": spec.max_graphics_clock_mhz, "max_memory_clock_mhz": spec.max_memory_clock_mhz,
            "locked_clocks_mhz": st.locked_clocks_mhz,
            "gpc_clock_offset_mhz": st.gpc_clock_offset_mhz, "gpc_clock_offset_range_mhz": spec.gpc_clock_offset_range_mhz,
            "mem_clock_offset_mhz": st.mem_clock_offset_mhz, "mem_clock_offset_range_mhz": spec.mem_clock_offset_range_mhz,
            "fans": tuple(FanState(i, sp, po if po in ("auto", "manual") else None)  # type: ignore[arg-type]
                          for i, (sp, po) in enumerate(zip(st.fan_speeds, st.fan_policies, strict=True))),
            "fan_speed_range_percent": spec.fan_speed_range_percent if spec.fans else None,
            "persistence_mode": st.persistence_mode, "temperature_c": spec.temperature_c,
            "clock_event_reasons": ("gpu_idle",),
        }
        # GeForce cards have no application clocks: like NVML on them, the simulator says not supported.
        for name in ("applications_graphics_clock_mhz", "applications_memory_clock_mhz",
                     "default_applications_graphics_clock_mhz", "default_applications_memory_clock_mhz"):
            unavailable[name] = NOT_SUPPORTED
        if not spec.readable_locked_clocks:
            values["locked_clocks_mhz"] = None
            unavailable["locked_clocks_mhz"] = LOCKED_CLOCKS_UNREADABLE
        elif st.locked_clocks_mhz is None:
            unavailable["locked_clocks_mhz"] = NOT_LOCKED
        for name in spec.unsupported:
            for key in FAMILIES[name]:
                values[key] = None
                unavailable[key] = NOT_SUPPORTED
        return GpuSettings(index=index, name=self.name, source="simulated", read_at=time.time(), **values,
                           unavailable=unavailable)

    # -- SettingsWriter ---------------------------------------------------------------------------
    def write(self, index: int, change: SettingChange) -> None:
        spec = self.spec
        what = f"setting {change.describe()} on GPU {index}"
        if spec.writes_need_root:
            raise SettingsWriteError("no_permission", f"{what}: no permission (NVML answered Insufficient Permissions)",
                                     ROOT_FIX)
        family = "fans" if change.setting.startswith("fan") else change.setting
        if family in spec.unsupported or change.setting in spec.unsupported:
            raise SettingsWriteError("not_supported", f"{what}: not supported by this card or driver",
                                     f"remove {change.setting} from gpu_profile in tenants.json")
        with self._lock:
            st = self._state
            v = change.value
            if change.setting == "power_limit_w":
                lo, hi = spec.power_limit_range_w
                if not (isinstance(v, (int, float)) and lo <= v <= hi):
                    raise SettingsWriteError("invalid", f"{what}: the driver refused the value (Invalid Argument)",
                                             "choose a value in the card's range (GET /api/gpu shows it)")
                st.power_limit_w = float(v)
            elif change.setting == "locked_clocks_mhz" and isinstance(v, tuple):
                st.locked_clocks_mhz = (int(v[0]), min(int(v[1]), spec.max_graphics_clock_mhz))
            elif change.setting == "gpc_clock_offset_mhz" and isinstance(v, int):
                st.gpc_clock_offset_mhz = v
            elif change.setting == "mem_clock_offset_mhz" and isinstance(v, int):
                st.mem_clock_offset_mhz = v
            elif change.setting == "fan_policy" and change.fan is not None and change.fan < len(st.fan_policies):
                st.fan_policies[change.fan] = str(v)
                if v == "auto":
                    st.fan_speeds[change.fan] = spec.fan_speed_percent
            elif change.setting == "fan_speed_percent" and change.fan is not None and change.fan < len(st.fan_speeds) \
                    and isinstance(v, int) and spec.fan_speed_range_percent[0] <= v <= spec.fan_speed_range_percent[1]:
                st.fan_policies[change.fan] = "manual"
                st.fan_speeds[change.fan] = v
            else:
                raise SettingsWriteError("invalid", f"{what}: no such setting on the simulated card", "check the profile")
            self.writes.append((index, change))
