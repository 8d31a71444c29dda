"""gpu_profile: validation in tenants.json, and the pure comparison with the card's settings."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config.settings import GpuProfile
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.gpu.profile import compare, plan_changes, reset_reason
from proxy.gpu.settings import LOCKED_CLOCKS_UNREADABLE, NO_PERMISSION, NOT_LOCKED, NOT_SUPPORTED, FanState, GpuSettings
from proxy.gpu.settings_writer import SettingChange


def card(**kw: Any) -> GpuSettings:
    base: dict[str, Any] = dict(index=0, name="card", source="nvml", read_at=0.0, power_limit_w=450.0,
                                power_limit_default_w=450.0, power_limit_range_w=(150.0, 600.0), max_graphics_clock_mhz=3000,
                                gpc_clock_offset_mhz=0, gpc_clock_offset_range_mhz=(-500, 500), mem_clock_offset_mhz=0,
                                mem_clock_offset_range_mhz=(-1000, 1000),
                                fans=(FanState(0, 30, "auto"), FanState(1, 31, "auto")), fan_speed_range_percent=(30, 100),
                                persistence_mode=True,
                                unavailable={"locked_clocks_mhz": LOCKED_CLOCKS_UNREADABLE})
    base.update(kw)
    return GpuSettings(**base)


def profile(**kw: Any) -> GpuProfile:
    return GpuProfile.model_validate(kw)


def status(checks: Any) -> dict[str, str]:
    return {c.setting: c.status for c in checks}


# -- tenants.json -----------------------------------------------------------------------------------

def test_gpu_profile_loads_with_apply_off_by_default() -> None:
    reg = registry_from_dict({"gpu_profile": {"power_limit_w": 300, "locked_clocks_mhz": {"min": 900, "max": 2100}}})
    p = reg.config.gpu_profile
    assert p is not None and p.apply is False and p.power_limit_w == 300 and p.locked_clocks_mhz is not None
    assert registry_from_dict({}).config.gpu_profile is None


@pytest.mark.parametrize(("body", "says"), [
    ({"power_limit_w": -5}, "gpu_profile.power_limit_w"),
    ({"power_limit_w": 300, "apply": "yes"}, "gpu_profile.apply"),
    ({"locked_clocks_mhz": {"min": 2000, "max": 1000}}, "must not be above max"),
    ({"fan_speed_percent": 50}, "needs fan_policy"),
    ({"fan_policy": "manual"}, "needs fan_speed_percent"),
    ({"fan_policy": "manual", "fan_speed_percent": 150}, "gpu_profile.fan_speed_percent"),
    ({"apply": True}, "sets nothing"),
    ({"power_limt_w": 300}, "unknown key"),
])
def test_bad_gpu_profiles_fail_at_load_naming_the_field(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        registry_from_dict({"gpu_profile": body})
    text = " ".join(info.value.problems)
    assert says in text, text


# -- compare ----------------------------------------------------------------------------------------

def test_a_matching_card_is_ok_and_nothing_is_written() -> None:
    p = profile(power_limit_w=450, gpc_clock_offset_mhz=0, fan_policy="auto")
    checks = compare(p, card())
    assert status(checks) == {"power_limit_w": "ok", "gpc_clock_offset_mhz": "ok", "fan_policy": "ok"}
    assert plan_changes(p, card(), checks, rewrite_unreadable=True) == []


def test_power_limit_drift_says_what_it_costs_and_how_to_set_it_by_hand() -> None:
    (c,) = compare(profile(power_limit_w=300), card())
    assert (c.status, c.desired, c.actual) == ("drift", 300, 450.0)
    assert "150 W more" in (c.cost or "") and c.by_hand == "sudo nvidia-smi -i 0 -pl 300"
    (low,) = compare(profile(power_limit_w=500), card())
    assert "below the profile" in (low.cost or "")


def test_values_outside_the_cards_ranges_are_named_unsupported() -> None:
    checks = compare(profile(power_limit_w=700, gpc_clock_offset_mhz=900, locked_clocks_mhz={"min": 500, "max": 3500}),
                     card())
    assert status(checks) == {"power_limit_w": "unsupported", "gpc_clock_offset_mhz": "unsupported",
                              "locked_clocks_mhz": "unsupported"}
    notes = " | ".join(c.note for c in checks)
    assert "150-600 W" in notes and "-500 to +500" in notes and "3000 MHz" in notes
    assert plan_changes(profile(power_limit_w=700), card(), checks, rewrite_unreadable=True) == []


def test_settings_the_card_does_not_support_are_named_unsupported_not_drift() -> None:
    s = card(power_limit_w=None, power_limit_range_w=None, fans=None,
             unavailable={"power_limit_w": NOT_SUPPORTED, "fans": NOT_SUPPORTED})
    checks = compare(profile(power_limit_w=300, fan_policy="auto"), s)
    assert status(checks) == {"power_limit_w": "unsupported", "fan_policy": "unsupported"}
    passive = compare(profile(fan_policy="auto"), card(fans=()))
    assert status(passive) == {"fan_policy": "unsupported"} and "no fans" in passive[0].note


def test_no_permission_to_read_is_unreadable_with_the_reason() -> None:
    s = card(gpc_clock_offset_mhz=None, gpc_clock_offset_range_mhz=None, unavailable={"gpc_clock_offset_mhz": NO_PERMISSION})
    (c,) = compare(profile(gpc_clock_offset_mhz=100), s)
    assert c.status == "unreadable" and "root" in c.note


def test_nvml_locked_clocks_are_unreadable_and_written_only_when_a_rewrite_is_due() -> None:
    p = profile(locked_clocks_mhz={"min": 1000, "max": 2000})
    checks = compare(p, card())
    assert status(checks) == {"locked_clocks_mhz": "unreadable"}
    assert plan_changes(p, card(), checks, rewrite_unreadable=False) == []
    assert plan_changes(p, card(), checks, rewrite_unreadable=True) == [SettingChange("locked_clocks_mhz", (1000, 2000))]


def test_readable_locked_clocks_compare_and_unlocked_is_drift() -> None:
    p = profile(locked_clocks_mhz={"min": 1000, "max": 2000})
    assert status(compare(p, card(locked_clocks_mhz=(1000, 2000), unavailable={}))) == {"locked_clocks_mhz": "ok"}
    assert status(compare(p, card(locked_clocks_mhz=(500, 2000), unavailable={}))) == {"locked_clocks_mhz": "drift"}
    assert status(compare(p, card(unavailable={"locked_clocks_mhz": NOT_LOCKED}))) == {"locked_clocks_mhz": "drift"}


def test_manual_fans_write_the_speed_on_every_fan() -> None:
    p = profile(fan_policy="manual", fan_speed_percent=60)
    checks = compare(p, card())
    assert status(checks) == {"fan_policy": "drift", "fan_speed_percent": "drift"}
    assert plan_changes(p, card(), checks, rewrite_unreadable=False) == [
        SettingChange("fan_speed_percent", 60, fan=0), SettingChange("fan_speed_percent", 60, fan=1)]
    near = card(fans=(FanState(0, 59, "manual"), FanState(1, 62, "manual")))
    assert status(compare(p, near)) == {"fan_policy": "ok", "fan_speed_percent": "ok"}


def test_fans_left_on_manual_drift_back_to_auto_fan_by_fan() -> None:
    p = profile(fan_policy="auto")
    s = card(fans=(FanState(0, 80, "manual"), FanState(1, 31, "auto")))
    checks = compare(p, s)
    assert "may run hot" in (checks[0].cost or "")
    assert plan_changes(p, s, checks, rewrite_unreadable=False) == [SettingChange("fan_policy", "auto", fan=0)]


# -- reset detection --------------------------------------------------------------------------------

def test_reset_is_suspected_at_start_after_a_failed_read_and_when_persistence_flips() -> None:
    p = profile(power_limit_w=300)
    now = card(power_limit_w=300.0)
    ok = compare(p, now)
    assert reset_reason(None, (), now, ok, read_failed_between=False) is not None
    assert reset_reason(now, ok, now, ok, read_failed_between=False) is None
    assert "driver reload" in (reset_reason(now, ok, now, ok, read_failed_between=True) or "")
    off = card(power_limit_w=300.0, persistence_mode=False)
    assert "persistence mode went off" in (reset_reason(now, ok, off, ok, read_failed_between=False) or "")


def test_a_setting_that_was_ok_and_falls_back_to_default_signals_a_reset() -> None:
    p = profile(power_limit_w=300)
    before = card(power_limit_w=300.0)
    after = card()  # back to the 450 W default
    reason = reset_reason(before, compare(p, before), after, compare(p, after), read_failed_between=False)
    assert reason is not None and "power_limit_w" in reason


def test_a_manual_fan_speed_below_the_cards_floor_is_unsupported_and_never_written() -> None:
    p = profile(fan_policy="manual", fan_speed_percent=10)
    checks = compare(p, card())
    assert status(checks) == {"fan_policy": "drift", "fan_speed_percent": "unsupported"}
    assert "30-100 %" in checks[1].note
    assert plan_changes(p, card(), checks, rewrite_unreadable=True) == [], "a fan too slow could overheat the card"
