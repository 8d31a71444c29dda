"""Admin-side extensions see the proxy through a read-only view, and find each other by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.routing import BaseRoute

from proxy.admin.health import HealthExtension, TelemetryReadings
from proxy.admin.proxy_view import ProxyView
from proxy.engines.loading import registry_from_dict
from proxy.service import Proxy
from proxy.sim.gpu import SimulatedGpu


class Recorder:
    name = "recorder"

    def __init__(self, view: ProxyView) -> None:
        self.view = view

    def routes(self) -> list[BaseRoute]:
        return []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class FakeTelemetry(Recorder):
    name = "telemetry"

    def healthy(self) -> tuple[bool, str]:
        return True, "fine"

    def min_vram(self, tenant: str, window_s: float) -> int | None:
        return 7


def proxy_with(*factories: type[Recorder]) -> Proxy:
    return Proxy(registry_from_dict({}), SimulatedGpu(), watchdog_enabled=False, extension_factories=list(factories))


def test_an_extension_gets_a_read_only_view_not_the_proxy() -> None:
    proxy = proxy_with(Recorder)
    (ext,) = proxy.extensions
    assert isinstance(ext, Recorder)
    view = ext.view
    assert isinstance(view, ProxyView) and not isinstance(view, Proxy)
    assert view.broker is proxy.broker and view.decisions is proxy.decisions and view.registry is proxy.registry
    for name in ("broker", "registry", "config_path", "token", "servers", "clock"):
        with pytest.raises(AttributeError):
            setattr(view, name, None)
    with pytest.raises(TypeError):
        view.servers["admin"] = None  # type: ignore[index]
    assert view.simulated_gpu is True


def test_the_view_follows_the_proxy_as_it_changes(tmp_path: Path) -> None:
    proxy = proxy_with(Recorder)
    view = proxy.view
    proxy.config_path = tmp_path / "tenants.json"
    assert view.config_path == tmp_path / "tenants.json"
    assert "admin" not in view.servers  # nothing bound yet: the same mapping the proxy fills on start


def test_extensions_find_each_other_by_name_not_by_shape() -> None:
    proxy = proxy_with(Recorder, FakeTelemetry)
    assert proxy.view.extension("recorder") is proxy.extensions[0]
    assert proxy.view.extension("nothing") is None
    found = proxy.view.extension("telemetry")
    assert isinstance(found, TelemetryReadings) and found.min_vram("x", 1.0) == 7
    health = HealthExtension(proxy.view)
    assert health.telemetry() is proxy.extensions[1]


def test_an_extension_that_only_looks_like_telemetry_is_not_taken_for_it() -> None:
    class Lookalike(Recorder):  # offers healthy() but does not call itself telemetry
        def healthy(self) -> tuple[bool, str]:
            return False, "not me"

    proxy = proxy_with(Lookalike)
    assert HealthExtension(proxy.view).telemetry() is None
