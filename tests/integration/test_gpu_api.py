"""GET /api/gpu, the gpu profile health entries and the drift decisions on the simulated box.
Writes go to the simulated card only (its own SettingsWriter); the real NVML writer raises under tests."""

from __future__ import annotations

from typing import Any

import httpx

from proxy.admin.gpu_api import GpuSettingsExtension, gpu_extension
from proxy.engines.loading import registry_from_dict
from proxy.gpu.nvml import NvmlReader
from proxy.gpu.settings_writer import ROOT_FIX
from proxy.service import Proxy
from tests.integration.boxes import DemoFactory, fast, proxy_of
from tests.unit.fake_pynvml import nvml_without_library


def gpu_ext(demo_or_proxy: Any) -> GpuSettingsExtension:
    proxy = getattr(demo_or_proxy, "proxy", demo_or_proxy)
    return next(e for e in proxy.extensions if isinstance(e, GpuSettingsExtension))


async def get(http: httpx.AsyncClient, demo: Any, path: str) -> Any:
    r = await http.get(proxy_of(demo).url("admin") + path)
    assert r.status_code == 200, r.text
    return r.json()


def entries(body: dict[str, Any], prefix: str = "gpu profile") -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in body["entries"] if e["name"].startswith(prefix)}


def with_profile(profile: dict[str, Any], card: dict[str, Any] | None = None) -> Any:
    return fast("gpu-drift", gpu={"settings": {"power_limit_w": 450.0, **(card or {})}}, settings={"gpu_profile": profile})


async def test_api_gpu_shows_the_simulated_cards_settings_without_a_profile(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    body = await get(http, demo, "/api/gpu")
    (dev,) = body["devices"]
    s = dev["settings"]
    assert (dev["index"], s["name"], s["source"]) == (0, "Simulated RTX 4090", "simulated")
    assert (s["power_limit_w"], s["power_limit_range_w"], s["persistence_mode"]) == (450.0, [150.0, 600.0], True)
    assert s["applications_graphics_clock_mhz"] is None
    assert s["unavailable"]["applications_graphics_clock_mhz"] == "not supported by this card or driver"
    assert [f["policy"] for f in s["fans"]] == ["auto", "auto"]
    assert body["profile"] is None and body["apply"] is None and "profile" not in dev
    health = await get(http, demo, "/api/health")
    assert entries(health)["gpu profile"]["status"] == "ok"


async def test_drift_is_a_health_entry_and_a_decision_and_nothing_is_written(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("gpu-drift")
    body = await get(http, demo, "/api/gpu")
    power = next(c for c in body["devices"][0]["profile"] if c["setting"] == "power_limit_w")
    assert (power["status"], power["desired"], power["actual"]) == ("drift", 300.0, 450.0)
    assert power["since"] is not None
    assert body["apply"]["enabled"] is False
    e = entries(await get(http, demo, "/api/health"))["gpu profile power_limit_w"]
    assert e["status"] == "degraded"
    assert "450 W" in e["problem"] and "300 W" in e["problem"] and "since" in e["problem"]
    assert "150 W more" in e["impact"]
    assert "gpu_profile.apply" in e["fix"] and "sudo nvidia-smi -i 0 -pl 300" in e["fix"]
    decisions = (await get(http, demo, "/api/decisions"))["decisions"]
    drift = [d for d in decisions if d["kind"] == "gpu_drift"]
    assert drift and drift[0]["outcome"]["started"] == ["power_limit_w"]
    assert demo.box.gpu.card_settings.writes == [] and demo.box.gpu.card_settings.read_settings(0).power_limit_w == 450.0


async def test_apply_writes_the_profile_and_rewrites_it_after_a_driver_reset(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(with_profile({"power_limit_w": 300.0, "apply": True}))
    card = demo.box.gpu.card_settings
    await gpu_ext(demo).keeper.check()
    assert card.read_settings(0).power_limit_w == 300.0
    health = entries(await get(http, demo, "/api/health"))
    assert [e["status"] for e in health.values()] == ["ok"] and "applied and matching" in health["gpu profile"]["problem"]
    card.driver_reset()
    await gpu_ext(demo).keeper.check()
    assert card.read_settings(0).power_limit_w == 300.0
    applied = [d for d in (await get(http, demo, "/api/decisions"))["decisions"] if d["kind"] == "gpu_apply"]
    assert len(applied) >= 2 and all(d["outcome"]["ok"] for d in applied)


async def test_apply_without_root_says_so_with_the_fix(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(with_profile({"power_limit_w": 300.0, "apply": True}, {"writes_need_root": True}))
    await gpu_ext(demo).keeper.check()
    health = entries(await get(http, demo, "/api/health"))
    apply = health["gpu profile apply"]
    assert apply["status"] == "failed" and "no permission" in apply["problem"] and apply["fix"] == ROOT_FIX
    assert health["gpu profile power_limit_w"]["fix"] == ROOT_FIX
    assert demo.box.gpu.card_settings.read_settings(0).power_limit_w == 450.0
    body = await get(http, demo, "/api/gpu")
    assert body["apply"]["error"]["kind"] == "no_permission" and body["apply"]["next_attempt_in_s"] > 0


async def test_profile_values_the_card_does_not_support_are_named(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(with_profile({"power_limit_w": 700.0, "fan_policy": "auto"}, {"unsupported": ["fans"]}))
    health = entries(await get(http, demo, "/api/health"))
    power, fans = health["gpu profile power_limit_w"], health["gpu profile fan_policy"]
    assert power["status"] == "degraded" and "outside the card's range 150-600 W" in power["problem"]
    assert fans["status"] == "degraded" and "not supported by this card or driver" in fans["problem"]
    assert fans["fix"] == "remove fan_policy from gpu_profile in tenants.json"


async def test_a_profile_for_a_gpu_that_is_not_there_fails_with_the_indices(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(with_profile({"power_limit_w": 300.0, "device": 3}))
    e = entries(await get(http, demo, "/api/health"))["gpu profile"]
    assert e["status"] == "failed" and "gpu_profile.device 3" in e["problem"] and e["fix"].endswith("0")


async def test_without_nvml_the_profile_cannot_be_compared_and_nothing_is_written() -> None:
    reader = NvmlReader(nvml=nvml_without_library())
    proxy = Proxy(registry_from_dict({"gpu_profile": {"power_limit_w": 300, "apply": True}}), reader,
                  extension_factories=[gpu_extension])
    ext = gpu_ext(proxy)
    (e,) = await ext.gpu_health()  # the real NVML writer raises under tests: a write would fail this test
    assert e.status == "unknown" and "library_missing" in (e.problem or "") and "install" in (e.fix or "")
    assert ext.keeper.report().model_dump(mode="json")["list_error"]["state"] == "library_missing"
    quiet = Proxy(registry_from_dict({}), reader, extension_factories=[gpu_extension])
    assert await gpu_ext(quiet).gpu_health() == [], "no profile and no card: nothing to claim (the nvml entry says why)"


async def test_locked_clocks_nvml_cannot_read_are_unknown_until_the_proxy_writes_them(box: DemoFactory,
                                                                                      http: httpx.AsyncClient) -> None:
    locked = {"locked_clocks_mhz": {"min": 900, "max": 2100}}
    compare_only = await box(with_profile(locked, {"readable_locked_clocks": False}))
    e = entries(await get(http, compare_only, "/api/health"))["gpu profile locked_clocks_mhz"]
    assert e["status"] == "unknown" and "reads locked clocks back" in e["problem"] and "apply to true" in e["fix"]
    applied = await box(with_profile({**locked, "apply": True}, {"readable_locked_clocks": False}))
    await gpu_ext(applied).keeper.check()
    health = entries(await get(http, applied, "/api/health"))
    assert list(health) == ["gpu profile"] and health["gpu profile"]["status"] == "ok"
    assert [c.setting for _, c in applied.box.gpu.card_settings.writes] == ["locked_clocks_mhz"]
