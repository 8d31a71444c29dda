"""The desired GPU profile against the card's settings: PURE decisions, no I/O, no clock.

`compare()` says, per setting the profile names, whether the card matches (ok), differs (drift),
cannot do it (unsupported: the card or driver lacks it, or the value is outside the card's range),
or cannot be checked (unreadable: NVML cannot read it back, or no permission to read).
`plan_changes()` turns that into the writes that would fix it, and `reset_reason()` says when the
driver has probably reset the card, so settings that cannot be read back are written again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from proxy.config.settings import GpuProfile
from proxy.gpu.settings import NOT_LOCKED, NOT_SUPPORTED, GpuSettings
from proxy.gpu.settings_writer import SettingChange, SettingName

FieldStatus = Literal["ok", "drift", "unsupported", "unreadable"]

POWER_TOLERANCE_W = 0.5  # NVML keeps milliwatts; a profile in watts matches when within half a watt
FAN_TOLERANCE_PERCENT = 3  # the reported speed trails a set speed by a percent or two


@dataclass(frozen=True, slots=True)
class FieldCheck:
    setting: SettingName
    status: FieldStatus
    desired: object  # the profile's value (a number, a [min, max] pair, a policy)
    actual: object  # the card's; None: not known (see note)
    note: str  # what a person needs to know: the two values, or why it cannot be checked or done
    cost: str | None = None  # drift: what it costs
    by_hand: str | None = None  # drift: a command that sets it without the proxy


def _missing(setting: SettingName, desired: object, reason: str | None, what: str) -> FieldCheck:
    if reason == NOT_SUPPORTED:
        return FieldCheck(setting, "unsupported", desired, None, f"{what}: {NOT_SUPPORTED}")
    return FieldCheck(setting, "unreadable", desired, None, f"{what} cannot be checked: {reason or 'not read'}")


def _power(p: GpuProfile, s: GpuSettings) -> FieldCheck:
    want = p.power_limit_w
    assert want is not None
    if s.power_limit_w is None:
        return _missing("power_limit_w", want, s.unavailable.get("power_limit_w"), "the power limit")
    have = s.power_limit_w
    rng = s.power_limit_range_w
    if rng is not None and not rng[0] - POWER_TOLERANCE_W <= want <= rng[1] + POWER_TOLERANCE_W:
        return FieldCheck("power_limit_w", "unsupported", want, have,
                          f"{want:g} W is outside the card's range {rng[0]:g}-{rng[1]:g} W")
    if abs(have - want) <= POWER_TOLERANCE_W:
        return FieldCheck("power_limit_w", "ok", want, have, f"{have:g} W")
    cost = (f"the card may draw up to {have - want:g} W more than the profile allows (heat, noise, power-supply headroom)"
            if have > want else f"the card is held {want - have:g} W below the profile: long generations run slower")
    return FieldCheck("power_limit_w", "drift", want, have, f"power limit is {have:g} W, the profile wants {want:g} W",
                      cost, f"sudo nvidia-smi -i {s.index} -pl {want:g}")


def _locked(p: GpuProfile, s: GpuSettings) -> FieldCheck:
    assert p.locked_clocks_mhz is not None
    want = (p.locked_clocks_mhz.min, p.locked_clocks_mhz.max)
    top = s.max_graphics_clock_mhz
    if top is not None and want[1] > top:
        return FieldCheck("locked_clocks_mhz", "unsupported", list(want), None,
                          f"{want[1]} MHz is above the card's highest graphics clock ({top} MHz)")
    if s.locked_clocks_mhz is None and s.unavailable.get("locked_clocks_mhz") == NOT_LOCKED:
        return FieldCheck("locked_clocks_mhz", "drift", list(want), None,
                          f"graphics clocks are not locked, the profile wants {want[0]}-{want[1]} MHz",
                          "the graphics clock runs outside the range the profile pins: speed and power vary from run to run",
                          f"sudo nvidia-smi -i {s.index} -lgc {want[0]},{want[1]}")
    if s.locked_clocks_mhz is None:
        return _missing("locked_clocks_mhz", list(want), s.unavailable.get("locked_clocks_mhz"), "locked clocks")
    have = s.locked_clocks_mhz
    if have == want:
        return FieldCheck("locked_clocks_mhz", "ok", list(want), list(have), f"{have[0]}-{have[1]} MHz")
    return FieldCheck("locked_clocks_mhz", "drift", list(want), list(have),
                      f"graphics clocks locked to {have[0]}-{have[1]} MHz, the profile wants {want[0]}-{want[1]} MHz",
                      "the graphics clock runs outside the range the profile pins: speed and power vary from run to run",
                      f"sudo nvidia-smi -i {s.index} -lgc {want[0]},{want[1]}")


def _offset(setting: Literal["gpc_clock_offset_mhz", "mem_clock_offset_mhz"], want: int, s: GpuSettings) -> FieldCheck:
    what = "graphics clock offset" if setting == "gpc_clock_offset_mhz" else "memory clock offset"
    have: int | None = getattr(s, setting)
    rng: tuple[int, int] | None = getattr(s, setting.replace("_mhz", "_range_mhz"))
    if rng is not None and not rng[0] <= want <= rng[1]:
        return FieldCheck(setting, "unsupported", want, have, f"{want:+d} MHz is outside the card's {what} range "
                          f"({rng[0]:+d} to {rng[1]:+d} MHz)")
    if have is None:
        return _missing(setting, want, s.unavailable.get(setting), f"the {what}")
    if have == want:
        return FieldCheck(setting, "ok", want, have, f"{have:+d} MHz")
    return FieldCheck(setting, "drift", want, have, f"{what} is {have:+d} MHz, the profile wants {want:+d} MHz",
                      "the clocks run on another curve than the tuned one: speed (and stability) differ from the profile")


def _fans(p: GpuProfile, s: GpuSettings) -> list[FieldCheck]:
    policy = p.fan_policy
    assert policy is not None
    if s.fans is None:
        return [_missing("fan_policy", policy, s.unavailable.get("fans"), "fan control")]
    if not s.fans:
        return [FieldCheck("fan_policy", "unsupported", policy, None,
                           "the card reports no fans NVML controls (passively cooled, or cooled by the case)")]
    out = [_fan_policy(policy, s)]
    if p.fan_speed_percent is not None:
        out.append(_fan_speed(p.fan_speed_percent, s))
    return out


def _fan_policy(policy: str, s: GpuSettings) -> FieldCheck:
    assert s.fans
    have = [f.policy for f in s.fans]
    if any(h is None for h in have):
        reasons = {s.unavailable.get(f"fans[{f.index}].policy") for f in s.fans if f.policy is None}
        return _missing("fan_policy", policy, reasons.pop() if len(reasons) == 1 else None, "the fan policy")
    if all(h == policy for h in have):
        return FieldCheck("fan_policy", "ok", policy, policy, policy)
    shown = ", ".join(f"fan {f.index} {f.policy}" for f in s.fans)
    cost = ("the fans run at a fixed speed and do not follow the temperature: the card may run hot"
            if policy == "auto" else "the fans follow the driver's curve, not the profile's fixed speed: "
            "noise and temperatures differ from the profile")
    return FieldCheck("fan_policy", "drift", policy, shown, f"fans are {shown}, the profile wants {policy}", cost)


def _fan_speed(want: int, s: GpuSettings) -> FieldCheck:
    assert s.fans
    rng = s.fan_speed_range_percent
    if rng is not None and not rng[0] <= want <= rng[1]:
        return FieldCheck("fan_speed_percent", "unsupported", want, [f.speed_percent for f in s.fans],
                          f"{want} % is outside the fans' range ({rng[0]}-{rng[1]} %)")
    speeds = [f.speed_percent for f in s.fans]
    if any(v is None for v in speeds):
        reasons = {s.unavailable.get(f"fans[{f.index}].speed") for f in s.fans if f.speed_percent is None}
        return _missing("fan_speed_percent", want, reasons.pop() if len(reasons) == 1 else None, "the fan speed")
    if all(abs(v - want) <= FAN_TOLERANCE_PERCENT for v in speeds if v is not None):
        return FieldCheck("fan_speed_percent", "ok", want, speeds, ", ".join(f"{v} %" for v in speeds))
    return FieldCheck("fan_speed_percent", "drift", want, speeds,
                      f"fans run at {', '.join(f'{v} %' for v in speeds)}, the profile wants {want} %",
                      "noise and temperatures differ from the profile")


def compare(profile: GpuProfile, settings: GpuSettings) -> tuple[FieldCheck, ...]:
    """One check per setting the profile names, in a fixed order."""
    out: list[FieldCheck] = []
    if profile.power_limit_w is not None:
        out.append(_power(profile, settings))
    if profile.locked_clocks_mhz is not None:
        out.append(_locked(profile, settings))
    if profile.gpc_clock_offset_mhz is not None:
        out.append(_offset("gpc_clock_offset_mhz", profile.gpc_clock_offset_mhz, settings))
    if profile.mem_clock_offset_mhz is not None:
        out.append(_offset("mem_clock_offset_mhz", profile.mem_clock_offset_mhz, settings))
    if profile.fan_policy is not None:
        out.extend(_fans(profile, settings))
    return tuple(out)


def plan_changes(profile: GpuProfile, settings: GpuSettings, checks: tuple[FieldCheck, ...], *,
                 rewrite_unreadable: bool) -> list[SettingChange]:
    """The writes that bring the card to the profile: every drifting setting, and the settings that
    cannot be read back when `rewrite_unreadable` (the first check, or after a suspected reset).
    Unsupported settings are never written."""
    status = {c.setting: c.status for c in checks}

    def wanted(setting: SettingName) -> bool:
        st = status.get(setting)
        return st == "drift" or (st == "unreadable" and rewrite_unreadable)

    out: list[SettingChange] = []
    if profile.power_limit_w is not None and wanted("power_limit_w"):
        out.append(SettingChange("power_limit_w", profile.power_limit_w))
    if profile.locked_clocks_mhz is not None and wanted("locked_clocks_mhz"):
        out.append(SettingChange("locked_clocks_mhz", (profile.locked_clocks_mhz.min, profile.locked_clocks_mhz.max)))
    if profile.gpc_clock_offset_mhz is not None and wanted("gpc_clock_offset_mhz"):
        out.append(SettingChange("gpc_clock_offset_mhz", profile.gpc_clock_offset_mhz))
    if profile.mem_clock_offset_mhz is not None and wanted("mem_clock_offset_mhz"):
        out.append(SettingChange("mem_clock_offset_mhz", profile.mem_clock_offset_mhz))
    return out + _fan_changes(profile, settings, status, wanted)


def _fan_changes(profile: GpuProfile, settings: GpuSettings, status: Mapping[SettingName, str],
                 wanted: Callable[[SettingName], bool]) -> list[SettingChange]:
    fans = settings.fans or ()
    if profile.fan_policy == "manual" and profile.fan_speed_percent is not None:
        if status.get("fan_speed_percent") != "unsupported" and (wanted("fan_policy") or wanted("fan_speed_percent")):
            # setting a speed puts the fan under manual control
            return [SettingChange("fan_speed_percent", profile.fan_speed_percent, fan=f.index) for f in fans]
    elif profile.fan_policy == "auto" and wanted("fan_policy"):
        return [SettingChange("fan_policy", "auto", fan=f.index) for f in fans if f.policy != "auto"]
    return []


def reset_reason(previous: GpuSettings | None, prev_checks: tuple[FieldCheck, ...], current: GpuSettings,
                 checks: tuple[FieldCheck, ...], *, read_failed_between: bool) -> str | None:
    """Why the card has probably been reset since the previous check (so settings NVML cannot read
    back must be written again), or None."""
    if previous is None:
        return "the first check since the proxy started"
    if read_failed_between:
        return "the card could not be read for a while and now can again (driver reload or GPU reset)"
    if previous.persistence_mode is not None and current.persistence_mode is not None \
            and previous.persistence_mode != current.persistence_mode:
        return (f"persistence mode went {'on' if current.persistence_mode else 'off'}: the driver re-initialises the "
                "card and drops its settings")
    was_ok = {c.setting for c in prev_checks if c.status == "ok"}
    lost = [c.setting for c in checks if c.status == "drift" and c.setting in was_ok]
    if lost:
        return f"{', '.join(lost)} changed back from the profile's value (driver reset, or someone else set it)"
    return None
