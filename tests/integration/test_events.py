"""GET /api/events and /openapi.json on the simulated box: real sockets, a real streaming client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from proxy.admin.api import AdminApi
from proxy.admin.events import EventsExtension, EventsSettings, _Subscriber, encode
from proxy.admin.openapi import OpenApiExtension, openapi_document
from proxy.admin.proxy_view import ProxyView
from proxy.demo import Demo, run_prompt
from proxy.engines.loading import registry_from_dict
from proxy.service import Proxy
from proxy.sim.box import SimBox
from proxy.tasks import poll_until
from tests.integration.boxes import ALL_PORTS_ZERO, DemoFactory, fast, proxy_of
from tests.json_reads import openapi_json

FAST = EventsSettings(tick_s=0.05, catalog_refresh_s=0.1)


@dataclass(frozen=True, slots=True)
class Event:
    id: int | None
    event: str | None
    data: Any
    raw_bytes: int
    retry: int | None = None


async def sse(response: httpx.Response) -> AsyncIterator[Event]:
    """Parse a text/event-stream as it arrives (one frame per blank line)."""
    fields: dict[str, str] = {}
    size = 0
    async for line in response.aiter_lines():
        size += len(line.encode()) + 1
        if line:
            key, _, value = line.partition(": ")
            fields[key] = value
            continue
        if fields:
            yield Event(int(fields["id"]) if "id" in fields else None, fields.get("event"),
                        json.loads(fields["data"]) if "data" in fields else None, size + 0,
                        int(fields["retry"]) if "retry" in fields else None)
        fields, size = {}, 0


async def next_event(events: AsyncIterator[Event], kind: str, timeout_s: float = 5.0) -> Event:
    async with asyncio.timeout(timeout_s):
        async for ev in events:
            if ev.event == kind:
                return ev
    raise AssertionError(f"the stream ended before a {kind!r} event")


@pytest.fixture
async def events_box() -> AsyncIterator[tuple[Demo, EventsExtension]]:
    """The default box with only the events extension, ticking fast."""
    box = SimBox(fast("default"))
    await box.start(ollama_port=0, comfyui_port=0)
    ext: list[EventsExtension] = []

    def make(p: ProxyView) -> EventsExtension:
        ext.append(EventsExtension(p, FAST))
        return ext[0]

    proxy = Proxy(registry_from_dict(box.tenant_overrides()), box.gpu, watchdog_enabled=False,
                  extension_factories=[make, OpenApiExtension])
    await proxy.start(ALL_PORTS_ZERO)
    demo = Demo(box, proxy)
    yield demo, ext[0]
    await demo.stop()


async def test_first_frames_carry_the_catalog_and_later_stats_frames_do_not(
        events_box: tuple[Demo, EventsExtension], http: httpx.AsyncClient) -> None:
    demo, _ = events_box
    async with http.stream("GET", proxy_of(demo).url("admin") + "/api/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = sse(r)
        first = await anext(frames)
        assert first.retry is not None and first.retry > 0, "a retry hint comes first so EventSource reconnects"
        catalog = await anext(frames)
        assert catalog.event == "catalog" and catalog.id is not None, catalog
        ollama = {m["name"]: m["size_bytes"] for m in catalog.data["tenants"]["ollama"]["models"]}
        assert "gemma3:27b" in ollama and ollama["gemma3:27b"] > 10**9, ollama
        comfy = [m["name"] for m in catalog.data["tenants"]["comfyui"]["models"]]
        assert "flux1-dev-fp8.safetensors" in comfy, comfy
        stats = [await anext(frames) for _ in range(3)]
        assert [s.event for s in stats] == ["stats"] * 3, "no catalog again while nothing changed"
        assert all("catalog" not in json.dumps(s.data) for s in stats)
        ids = [s.id for s in stats if s.id is not None]
        assert ids == sorted(ids) and len(set(ids)) == 3, ids
        names = {t["name"]: t for t in stats[-1].data["tenants"]}
        assert {"ollama", "comfyui"} <= set(names) and "idle_release_in_s" in names["comfyui"]
        assert stats[-1].data["device"]["total_bytes"] == demo.box.gpu.total_bytes


async def test_an_admin_release_produces_a_decision_event(events_box: tuple[Demo, EventsExtension],
                                                         http: httpx.AsyncClient) -> None:
    demo, _ = events_box
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    async with http.stream("GET", proxy_of(demo).url("admin") + "/api/events") as r:
        frames = sse(r)
        await next_event(frames, "stats")
        released = await http.post(proxy_of(demo).url("admin") + "/api/tenants/comfyui/release")
        assert released.status_code == 200, released.text
        seen = [await next_event(frames, "decision") for _ in range(2)]  # recorded, then its outcome
        assert {e.data["kind"] for e in seen} == {"release"} and seen[0].data["tenant"] == "comfyui"
        assert seen[-1].data["outcome"]["ok"] is True, seen[-1].data
        stats = await next_event(frames, "stats")
        assert seen[0].data["id"] in stats.data["decision_ids"]


async def test_pulling_a_model_yields_a_new_catalog_event(events_box: tuple[Demo, EventsExtension],
                                                         http: httpx.AsyncClient) -> None:
    demo, _ = events_box
    async with http.stream("GET", proxy_of(demo).url("admin") + "/api/events") as r:
        frames = sse(r)
        before = await next_event(frames, "catalog")
        assert "tinyllama:latest" not in {m["name"] for m in before.data["tenants"]["ollama"]["models"]}
        pulled = await http.post(proxy_of(demo).url("ollama") + "/api/pull", json={"model": "tinyllama", "stream": False})
        assert pulled.status_code == 200, pulled.text
        after = await next_event(frames, "catalog")
        assert after.id is not None and before.id is not None and after.id > before.id
        assert "tinyllama:latest" in {m["name"] for m in after.data["tenants"]["ollama"]["models"]}


async def test_client_disconnect_removes_the_subscriber(events_box: tuple[Demo, EventsExtension],
                                                       http: httpx.AsyncClient) -> None:
    demo, ext = events_box
    async with http.stream("GET", proxy_of(demo).url("admin") + "/api/events") as r:
        await next_event(sse(r), "stats")
        assert ext.subscriber_count == 1
    async with asyncio.timeout(5):
        await poll_until(lambda: not ext.subscriber_count, 0.01)


async def test_reconnect_with_last_event_id_replays_missed_decisions(events_box: tuple[Demo, EventsExtension],
                                                                    http: httpx.AsyncClient) -> None:
    demo, _ = events_box
    admin = proxy_of(demo).url("admin")
    async with http.stream("GET", admin + "/api/events") as r:
        last = await next_event(sse(r), "stats")
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    assert (await http.post(admin + "/api/tenants/comfyui/release")).status_code == 200
    async with http.stream("GET", admin + "/api/events", headers={"Last-Event-ID": str(last.id)}) as r:
        missed = await next_event(sse(r), "decision")
        assert missed.data["kind"] == "release" and missed.id is not None and missed.id > (last.id or 0)


def test_a_slow_subscriber_drops_old_stats_never_decisions() -> None:
    sub = _Subscriber(EventsSettings(stats_backlog=2, max_queued=50))
    for i in range(1, 11):
        sub.push(encode(i, "decision" if i % 3 == 0 else "stats", {"n": i}))
    kinds = [(f.kind, f.seq) for f in sub.frames]
    assert [s for k, s in kinds if k == "decision"] == [3, 6, 9], kinds
    assert [s for k, s in kinds if k == "stats"] == [8, 10], "only the newest stats frames stay queued"
    assert not sub.overflowed


def test_a_subscriber_too_far_behind_on_decisions_is_closed_not_trimmed() -> None:
    sub = _Subscriber(EventsSettings(max_queued=5))
    for i in range(6):
        sub.push(encode(i, "decision", {"n": i}))
    assert sub.overflowed and len(sub.frames) == 6, "every decision kept until the stream is closed"


async def test_stats_frame_is_small_without_the_catalog(events_box: tuple[Demo, EventsExtension],
                                                        http: httpx.AsyncClient) -> None:
    demo, _ext = events_box
    async with http.stream("GET", proxy_of(demo).url("admin") + "/api/events") as r:
        frames = sse(r)
        catalog = await next_event(frames, "catalog")
        stats = await next_event(frames, "stats")
    print(f"\nstats frame {stats.raw_bytes} B; catalog frame {catalog.raw_bytes} B; "
          f"both in every frame would be {stats.raw_bytes + catalog.raw_bytes} B")
    assert stats.raw_bytes < catalog.raw_bytes + stats.raw_bytes
    assert "models" not in json.dumps(stats.data)


# -- /openapi.json ----------------------------------------------------------------------------

def mounted_routes(proxy: Proxy) -> set[tuple[str, str]]:
    admin = AdminApi(proxy.broker, proxy.watchdog, proxy.engines, proxy.token)
    app = admin.app([route for ext in proxy.extensions for route in ext.routes()])
    out = set()
    for route in app.routes:
        assert isinstance(route, Route), route
        for method in route.methods or ():
            if method != "HEAD":
                out.add((route.path, method.lower()))
    return out


async def test_openapi_documents_every_mounted_admin_route(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.get(proxy_of(demo).url("admin") + "/openapi.json")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    missing = mounted_routes(proxy_of(demo)) - documented
    assert not missing, f"admin routes without an OpenAPI operation (add them in proxy/openapi.py): {missing}"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op.get("x-undocumented") is not True, f"{method.upper()} {path} has no hand-written operation"
            assert op["responses"], f"{method.upper()} {path} lists no responses"


def test_openapi_release_route_needs_bearer_and_lists_its_statuses() -> None:
    doc = openapi_json()
    op = doc["paths"]["/api/tenants/{name}/release"]["post"]
    assert op["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert set(op["responses"]) >= {"200", "401", "403", "404", "409", "502", "504"}
    assert "security" not in doc["paths"]["/api/tenants"]["get"], "reads stay open"


def test_openapi_refs_all_resolve() -> None:
    doc = openapi_json()
    schemas = doc["components"]["schemas"]
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs, "the document uses component schemas"
    for ref in refs:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[-1] in schemas, ref
    assert {"error", "fix"} <= set(schemas["Error"]["properties"])
    assert {"blockers", "plan", "need_gb"} <= set(schemas["Rejection"]["properties"])


def test_openapi_passes_the_spec_validator() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(openapi_document())
