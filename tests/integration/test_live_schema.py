"""Live admin answers from a running demo box, validated against the box's own /openapi.json.

The document is built from the same models the handlers build their answers with
(proxy/admin/views.py); this holds the two together: every answer validates against the schema of
its route and status, and carries no key the schema does not name (a field added to an answer
without documenting it fails here, not in a client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
from jsonschema import Draft202012Validator

from proxy.demo import run_prompt
from proxy.gpu.snapshot import GpuReadError, GpuSnapshot
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, fast, free_port, process_tenant, proxy_of

JSON = dict[str, Any]


def resolve(schema: JSON, doc: JSON) -> JSON:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = doc["components"]["schemas"][name]
    return schema


def undocumented(value: Any, schema: JSON, doc: JSON, where: str = "$") -> list[str]:
    """Keys present in the answer that its schema does not name (schemas allow extra keys, so a
    plain validation would not see them)."""
    schema = resolve(schema, doc)
    out: list[str] = []
    for alt in schema.get("anyOf", []) + schema.get("oneOf", []):
        if Draft202012Validator({**alt, "components": doc["components"]}).is_valid(value):
            return undocumented(value, alt, doc, where)
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        out += [f"{where}.{k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += undocumented(v, props[k], doc, f"{where}.{k}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in value.items():
            out += undocumented(v, schema["additionalProperties"], doc, f"{where}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += undocumented(v, schema["items"], doc, f"{where}[{i}]")
    return out


def check(doc: JSON, schema: JSON, body: Any, what: str) -> None:
    validator = Draft202012Validator({**schema, "components": doc["components"]})
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors, f"{what} does not match /openapi.json: " + "; ".join(
        f"{'/'.join(map(str, e.path))}: {e.message[:300]}" for e in errors[:5])
    extra = undocumented(body, schema, doc)
    assert not extra, f"{what} carries keys /openapi.json does not name: {extra[:20]}"


def response_schema(doc: JSON, path: str, method: str, status: int) -> JSON:
    op = doc["paths"][path][method]
    answer = op["responses"].get(str(status))
    assert answer is not None, f"{method.upper()} {path} answered {status}, which /openapi.json does not list"
    schema: JSON = answer["content"]["application/json"]["schema"]
    return schema


async def call(http: httpx.AsyncClient, doc: JSON, admin: str, method: str, route: str, url: str,
               status: int) -> JSON:
    r = await http.request(method, admin + url)
    assert r.status_code == status, (url, r.status_code, r.text[:500])
    body: JSON = r.json()
    check(doc, response_schema(doc, route, method.lower(), status), body, f"{method} {url} ({status})")
    return body


async def test_live_admin_answers_match_the_openapi_document(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    doc = (await http.get(admin + "/openapi.json")).json()
    # Traffic that leaves decisions of several kinds: a render, then a load that releases ComfyUI.
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text

    checked = [
        ("GET", "/api/tenants", "/api/tenants", 200),
        ("GET", "/api/tenants/{name}", "/api/tenants/ollama", 200),
        ("GET", "/api/tenants/{name}", "/api/tenants/no-such-tenant", 404),
        ("GET", "/api/plan", "/api/plan?tenant=comfyui&need_gb=20", 200),
        ("GET", "/api/plan", "/api/plan?tenant=comfyui&need_gb=nan", 400),
        ("GET", "/api/decisions", "/api/decisions", 200),
        ("GET", "/api/stats", "/api/stats", 200),
        ("GET", "/api/health", "/api/health", 200),
        ("GET", "/api/engines", "/api/engines", 200),
        ("GET", "/api/history", "/api/history", 200),
        ("GET", "/api/history", "/api/history?kind=nope", 400),
        ("POST", "/api/tenants/{name}/release", "/api/tenants/ollama/release", 200),
        ("POST", "/api/tenants/{name}/release", "/api/tenants/desktop/release", 409),
    ]
    answers = {url: await call(http, doc, admin, method, route, url, status)
               for method, route, url, status in checked}

    after = await call(http, doc, admin, "GET", "/api/decisions", "/api/decisions", 200)  # with the releases above
    kinds = {d["kind"] for d in after["decisions"]}
    assert {"plan", "release"} <= kinds, f"the traffic should have left plans and releases: {kinds}"
    plan = next(d for d in after["decisions"] if d["kind"] == "plan" and d["trigger"].startswith("request "))
    detail = await call(http, doc, admin, "GET", "/api/decisions/{id}", f"/api/decisions/{plan['id']}", 200)
    assert detail["story"] is not None and detail["story"]["first_byte_s"] is not None, detail["story"]
    await call(http, doc, admin, "GET", "/api/decisions/{id}", "/api/decisions/999999", 404)
    await call(http, doc, admin, "GET", "/api/decisions/{id}", "/api/decisions/nope", 400)
    released = answers["/api/tenants/ollama/release"]
    assert released["result"] == "confirmed" and released["confirmed"] is True, released
    tenants = {t["name"]: t for t in answers["/api/tenants"]["tenants"]}
    assert tenants["ollama"]["config"]["engine"] == "ollama" and "vram_bytes" in tenants["comfyui"]


async def test_event_frames_match_the_openapi_document(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    doc = (await http.get(admin + "/openapi.json")).json()
    frames = doc["paths"]["/api/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]["x-event-data"]
    seen: dict[str, JSON] = {}
    async with http.stream("GET", admin + "/api/events") as stream:
        released = False
        async with asyncio.timeout(20):
            event: str | None = None
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event is not None:
                    seen.setdefault(event, json.loads(line[6:]))
                if {"catalog", "stats"} <= set(seen) and not released:
                    released = True  # an admin release records a decision, which the stream carries
                    r = await http.post(admin + "/api/tenants/comfyui/release")
                    assert r.status_code == 200, r.text
                if {"catalog", "stats", "decision"} <= set(seen):
                    break
    assert {"catalog", "stats", "decision"} <= set(seen), set(seen)
    for kind, body in seen.items():
        check(doc, frames[kind], body, f"the {kind} frame")


async def test_answers_without_a_gpu_reader_match_the_document_too(box: DemoFactory, http: httpx.AsyncClient) -> None:
    """Unknown figures are null there (device, tenants nobody sees, gpu_error set): still as documented."""
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    doc = (await http.get(admin + "/openapi.json")).json()

    class Broken:
        def read(self) -> GpuSnapshot:
            raise GpuReadError("driver_mismatch", "Failed to initialize NVML: Driver/library version mismatch",
                               "reboot to load the new driver")

    proxy_of(demo).broker.reader = Broken()
    stats = await call(http, doc, admin, "GET", "/api/stats", "/api/stats", 200)
    assert stats["gpu_error"]["state"] == "driver_mismatch" and stats["device"]["source"] == "engine-estimate", stats
    assert stats["device"]["reserved_bytes"] is None, "ComfyUI reports no reserved figure: null, never 0"
    await call(http, doc, admin, "GET", "/api/tenants", "/api/tenants", 200)
    await call(http, doc, admin, "GET", "/api/health", "/api/health", 200)


async def test_lifecycle_answers_and_frames_match_the_document(box: DemoFactory, http: httpx.AsyncClient,
                                                               tmp_path: Path) -> None:
    """A tenant the proxy starts and stops: its lifecycle in /api/tenants, the start and stop answers,
    the refusals, and the event stream's lifecycle frames, all as documented."""
    demo = await box(fast("default", tenants={"app": process_tenant(free_port(), tmp_path)}))
    admin = proxy_of(demo).url("admin")
    doc = (await http.get(admin + "/openapi.json")).json()
    frames = doc["paths"]["/api/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]["x-event-data"]
    seen: list[JSON] = []

    async def watch() -> None:
        async with http.stream("GET", admin + "/api/events") as stream:
            event: str | None = None
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "lifecycle":
                    seen.append(json.loads(line[6:]))

    watcher = asyncio.create_task(watch())
    try:
        checked = [
            ("GET", "/api/tenants", "/api/tenants", 200),
            ("POST", "/api/tenants/{name}/start", "/api/tenants/app/start", 200),
            ("POST", "/api/tenants/{name}/start", "/api/tenants/app/start", 200),  # runs already: a note
            ("GET", "/api/tenants/{name}", "/api/tenants/app", 200),
            ("GET", "/api/stats", "/api/stats", 200),
            ("POST", "/api/tenants/{name}/stop", "/api/tenants/app/stop", 200),
            ("POST", "/api/tenants/{name}/stop", "/api/tenants/ollama/stop", 409),
            ("POST", "/api/tenants/{name}/start", "/api/tenants/desktop/start", 409),
            ("POST", "/api/tenants/{name}/start", "/api/tenants/no-such-tenant/start", 404),
        ]
        answers = [await call(http, doc, admin, method, route, url, status) for method, route, url, status in checked]
        assert answers[1]["lifecycle"]["state"] == "running" and answers[5]["lifecycle"]["state"] == "stopped"
        async with asyncio.timeout(10):
            await poll_until(lambda: len([f for f in seen if f["report"] is not None]) >= 2)  # start's, stop's
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert [f["report"]["action"] for f in seen if f["report"]] == ["start", "stop"], seen
    for frame in seen:
        check(doc, frames["lifecycle"], frame, "a lifecycle frame")
