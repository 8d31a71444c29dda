"""The admin API answers 4xx, never 5xx, to bad input: numbers that are not finite or out of their
documented range, limits above the maximum, methods a route does not take (with `Allow`)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.boxes import DemoFactory, proxy_of
from tests.json_reads import openapi_json

# One box per test (starting one costs about a second); the bad values are looped over inside.

async def test_plan_refuses_a_need_that_is_no_sane_gib_amount_with_400(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    for need in ("1e308", "inf", "-inf", "nan", "-1", "16385", "lots", ""):
        r = await http.get(proxy_of(demo).url("admin") + "/api/plan", params={"tenant": "ollama", "need_gb": need})
        assert r.status_code == 400, f"need_gb={need!r}: {r.status_code} {r.text[:200]}"
        body = r.json()
        assert "need_gb" in body["error"] and body.get("fix"), body
    for need in ("0", "16384", "2.5"):
        r = await http.get(proxy_of(demo).url("admin") + "/api/plan", params={"tenant": "ollama", "need_gb": need})
        assert r.status_code == 200, f"need_gb={need}: {r.text[:200]}"


async def test_history_and_decisions_refuse_bad_since_and_limits_with_400(box: DemoFactory,
                                                                          http: httpx.AsyncClient) -> None:
    admin = proxy_of(await box("default")).url("admin")
    for params in ({"since": "nan"}, {"since": "inf"}, {"since": "-inf"}, {"since": "yesterday"},
                   {"limit": "10001"}, {"limit": "0"}, {"limit": "1e3"}):
        r = await http.get(admin + "/api/history", params=params)
        assert r.status_code == 400, f"/api/history {params}: {r.status_code} {r.text[:200]}"
        assert r.json().get("fix"), r.text
    for limit in ("501", "0", "-3", "ten"):
        r = await http.get(admin + "/api/decisions", params={"limit": limit})
        assert r.status_code == 400, f"/api/decisions limit={limit}: {r.status_code} {r.text[:200]}"
        assert "500" in r.json()["error"], r.text
    assert (await http.get(admin + "/api/history", params={"since": "0", "limit": "10000"})).status_code == 200
    assert (await http.get(admin + "/api/decisions", params={"limit": "500"})).status_code == 200


async def test_a_method_a_route_does_not_take_answers_405_with_allow(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    r = await http.delete(admin + "/api/tenants")
    assert r.status_code == 405 and "GET" in r.headers.get("allow", ""), (r.status_code, dict(r.headers))
    r = await http.get(admin + "/api/tenants/comfyui/release")
    assert r.status_code == 405 and r.headers.get("allow") == "POST", (r.status_code, dict(r.headers))
    assert r.json()["error"], r.text


async def test_openapi_marks_authorization_required_only_when_a_token_is_configured(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = await box("default")
    doc = (await http.get(proxy_of(demo).url("admin") + "/openapi.json")).json()
    release = doc["paths"]["/api/tenants/{name}/release"]["post"]
    assert "security" not in release, "no token configured: no Authorization needed"
    assert "401" not in release["responses"]
    # a foreign Origin is refused with or without a token: that 403 stays, and says nothing of a token
    assert "token" not in release["responses"]["403"]["description"]

    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "s3cret")
    guarded = await box("default")
    doc = (await http.get(proxy_of(guarded).url("admin") + "/openapi.json")).json()
    release = doc["paths"]["/api/tenants/{name}/release"]["post"]
    assert release["security"] == [{"bearer": []}] and {"401", "403"} <= set(release["responses"])


def test_openapi_documents_the_ranges_the_handlers_enforce() -> None:
    paths = openapi_json()["paths"]
    need = next(p for p in paths["/api/plan"]["get"]["parameters"] if p["name"] == "need_gb")["schema"]
    assert need["minimum"] == 0 and need["maximum"] == 16384
    history = {p["name"]: p["schema"] for p in paths["/api/history"]["get"]["parameters"]}
    assert history["limit"]["maximum"] == 10000 and history["limit"]["minimum"] == 1
    assert history["since"]["type"] == "number"
