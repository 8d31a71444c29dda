"""Admin security by default: loopback, a token for any other address, no CORS unless configured,
and tenant listeners that never answer admin routes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.service import Proxy
from proxy.sim.gpu import SimulatedGpu
from tests.integration.boxes import DemoFactory, fast, proxy_of


def test_admin_on_a_public_address_without_a_token_refuses_to_start() -> None:
    reg = registry_from_dict({"admin": {"listen": "0.0.0.0:11400"}})
    with pytest.raises(ConfigError) as err:
        Proxy(reg, SimulatedGpu(), extension_factories=[])
    assert "without a token" in err.value.message and "HYPERSWAP_ADMIN_TOKEN" in (err.value.fix or "")


def test_admin_on_a_public_address_starts_with_a_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("from-file\n")
    reg = registry_from_dict({"admin": {"listen": "0.0.0.0:11400", "token_file": str(token)}})
    assert Proxy(reg, SimulatedGpu(), extension_factories=[]).token == "from-file"


async def test_no_cors_headers_unless_configured(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.get(proxy_of(demo).url("admin") + "/api/tenants", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    pre = await http.options(proxy_of(demo).url("admin") + "/api/tenants/comfyui/release",
                             headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


async def test_configured_cors_origin_is_allowed(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", settings={"admin": {"cors_origins": ["http://dash.local"]}}))
    r = await http.get(proxy_of(demo).url("admin") + "/api/tenants", headers={"Origin": "http://dash.local"})
    assert r.headers.get("access-control-allow-origin") == "http://dash.local"


async def test_tenant_listeners_never_expose_admin_routes(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.get(proxy_of(demo).url("ollama") + "/api/tenants")
    assert r.status_code == 404 and r.text == "404 page not found", "forwarded to Ollama, which does not know it"
    r = await http.post(proxy_of(demo).url("comfyui") + "/api/tenants/comfyui/release")
    assert r.status_code in (404, 405) and "freed" not in r.text
