"""Model files in RAM on the simulated box: /api/models lists each tenant's models with residency,
warming reads them in (and stops), a handoff warms the next model while the other tenant releases,
and each load is recorded with its speed and residency before it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from proxy.admin.models_api import ModelsExtension
from proxy.demo import Demo, run_prompt
from proxy.sim.box import Scenario, fast_scenario
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, proxy_of

CKPT = "flux1-dev-fp8.safetensors"


def slow_loads(**proxy: Any) -> Scenario:
    """Loads slow enough that Ollama's load_duration says something (a 16 GiB model: ~0.35 s warm,
    ~0.7 s cold: a cold load is the slower, and 10 GB/s disks made these tests wait 1.7 s a load)."""
    return fast_scenario("default", ollama={"load_gbps": 50.0, "disk_gbps": 25.0}, settings={"proxy": proxy})


async def models(http: httpx.AsyncClient, demo: Demo, tenant: str = "ollama") -> dict[str, dict[str, Any]]:
    r = await http.get(proxy_of(demo).url("admin") + f"/api/models?tenant={tenant}")
    assert r.status_code == 200, r.text
    (entry,) = r.json()["tenants"]
    return {m["name"]: m for m in entry["models"]}


def cold_or_skip(demo: Demo) -> None:
    assert demo.box.files is not None
    if not demo.box.files.drop_all():
        pytest.skip(f"{demo.box.files.root}: this file system keeps pages on POSIX_FADV_DONTNEED (tmpfs?)")


async def test_models_are_listed_per_tenant_with_size_and_residency(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    cold_or_skip(demo)
    ollama = await models(http, demo)
    assert set(ollama) >= {"gemma3:27b", "llama3.1:8b"}
    gemma = ollama["gemma3:27b"]
    assert gemma["size_gb"] == 16.2 and gemma["folder"] == "ollama" and gemma["residency"]["resident_percent"] < 5
    comfy = await models(http, demo, "comfyui")
    assert comfy[CKPT]["folder"] == "checkpoints", "found from --base-directory on ComfyUI's command line"
    r = await http.get(proxy_of(demo).url("admin") + "/api/models?tenant=nobody")
    assert r.status_code == 404 and r.json()["fix"]


async def test_a_warm_reads_the_files_in_and_the_listing_shows_it_at_once(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    cold_or_skip(demo)
    admin = proxy_of(demo).url("admin")
    r = await http.post(admin + "/api/models/warm", json={"tenant": "ollama", "model": "llama3.1:8b"})
    assert r.status_code == 202, r.text
    m: dict[str, Any] = {}

    async def warmed() -> bool:  # the warm runs in a thread: no event to wait on from here
        nonlocal m
        m = (await models(http, demo))["llama3.1:8b"]
        return bool(m["warm"]["state"] == "done")

    async with asyncio.timeout(10):
        await poll_until(warmed, 0.02)
    assert m["warm"]["state"] == "done" and m["residency"]["resident_percent"] > 95, m
    r = await http.post(admin + "/api/models/stop", json={"tenant": "ollama", "model": "llama3.1:8b"})
    assert r.status_code == 409 and "no warm" in r.json()["error"]


@pytest.mark.parametrize(("body", "status"), [
    ({"tenant": "ollama"}, 400), ({"tenant": "ollama", "model": 3}, 400), ({"tenant": "x", "model": "m"}, 404),
    ({"tenant": "ollama", "model": "not-pulled"}, 404), ({"tenant": "ollama", "model": "m", "more": 1}, 400)])
async def test_a_bad_warm_request_says_what_to_send(box: DemoFactory, http: httpx.AsyncClient,
                                                     body: dict[str, Any], status: int) -> None:
    demo = await box("default")
    r = await http.post(proxy_of(demo).url("admin") + "/api/models/warm", json=body)
    assert r.status_code == status and r.json()["error"] and r.json()["fix"], r.text


async def test_a_handoff_warms_the_next_model_while_comfyui_releases_and_records_the_load(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(slow_loads())
    cold_or_skip(demo)
    assert demo.proxy is not None
    await run_prompt(proxy_of(demo).url("comfyui"), CKPT, http)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    gemma = (await models(http, demo))["gemma3:27b"]
    assert gemma["warm"] is not None and gemma["warm"]["reason"].startswith("handoff"), gemma
    assert gemma["residency"]["resident_percent"] > 95
    loads = (await http.get(proxy_of(demo).url("admin") + "/api/models/loads")).json()["loads"]
    (load,) = [x for x in loads if x["model"] == "gemma3:27b"]
    assert load["seconds"] == pytest.approx(r.json()["load_duration"] / 1e9, rel=1e-3)
    assert load["size_bytes"] == gemma["size_bytes"] and load["resident_before_percent"] is not None
    decisions = (await http.get(proxy_of(demo).url("admin") + "/api/decisions")).json()["decisions"]
    assert any(d["kind"] == "model_load" and d["outcome"]["model"] == "gemma3:27b" for d in decisions)


async def test_without_warm_during_release_the_load_reads_cold_from_disk(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(slow_loads(warm_during_release=False))
    cold_or_skip(demo)
    assert demo.proxy is not None
    await run_prompt(proxy_of(demo).url("comfyui"), CKPT, http)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    assert r.status_code == 200
    loads = (await http.get(proxy_of(demo).url("admin") + "/api/models/loads")).json()["loads"]
    (load,) = [x for x in loads if x["model"] == "gemma3:27b"]
    assert load["resident_before_percent"] < 5 and load["class"] == "cold", load
    assert (await models(http, demo))["gemma3:27b"]["warm"] is None
    metrics = (await http.get(proxy_of(demo).url("admin") + "/metrics")).text
    assert 'hyperswap_model_load_gbps_count{class="cold",tenant="ollama"} 1.0' in metrics, metrics[-2000:]


async def test_model_files_have_health_entries(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    body = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    entries = {e["name"]: e for e in body["entries"]}
    assert entries["model files ollama"]["status"] == "ok" and entries["model files comfyui"]["status"] == "ok"


async def test_warming_needs_the_token_when_one_is_configured(box: DemoFactory, http: httpx.AsyncClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "secret")
    demo = await box("default")
    url = proxy_of(demo).url("admin") + "/api/models/warm"
    body = {"tenant": "ollama", "model": "llama3.2:3b"}
    assert (await http.post(url, json=body)).status_code == 401
    assert (await http.post(url, json=body, headers={"Authorization": "Bearer secret"})).status_code == 202


async def test_a_comfyui_checkpoint_load_is_timed_from_its_execution_frames(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast_scenario("default", comfyui={"load_gbps": 20.0}))
    assert demo.proxy is not None
    await run_prompt(proxy_of(demo).url("comfyui"), CKPT, http)
    loads = (await http.get(proxy_of(demo).url("admin") + "/api/models/loads")).json()["loads"]
    (load,) = [x for x in loads if x["tenant"] == "comfyui"]
    assert load["model"] == CKPT and load["source"] == "comfyui execution frames"
    assert load["seconds"] >= 11.9 / 20.0 * 0.9, "the simulated load takes size / load_gbps"


async def test_keep_warm_models_warms_the_most_recently_used_models_again(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(slow_loads(keep_warm_models=2))
    cold_or_skip(demo)
    assert demo.proxy is not None and demo.box.files is not None
    for model in ("llama3.2:3b", "llama3.1:8b"):
        r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                            json={"model": model, "prompt": "hi", "stream": False})
        assert r.status_code == 200
    ext = next(e for e in proxy_of(demo).extensions if isinstance(e, ModelsExtension))
    await ext.settled()  # the policy's look after the second load is over
    demo.box.files.drop_all()  # the page cache let both go
    ext.catalog.residency.invalidate()  # what the proxy read before is at most residency_ttl_s old: not wait it out
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "qwen2.5:14b", "prompt": "hi", "stream": False})
    assert r.status_code == 200
    listed: dict[str, Any] = {}

    async def rewarmed() -> bool:
        nonlocal listed
        listed = await models(http, demo)
        return bool(listed["llama3.1:8b"]["warm"] and listed["llama3.1:8b"]["warm"]["state"] == "done")

    async with asyncio.timeout(10):
        await poll_until(rewarmed, 0.02)
    assert listed["llama3.1:8b"]["residency"]["resident_percent"] > 95, "one of the 2 most recently used"
    assert listed["llama3.1:8b"]["warm"]["reason"].startswith("keep the 2"), listed["llama3.1:8b"]
    assert listed["llama3.2:3b"]["residency"]["resident_percent"] < 5, "the third most recent stays cold"


async def test_two_requests_that_wait_on_one_load_record_it_once(box: DemoFactory, http: httpx.AsyncClient) -> None:
    """Open WebUI sends a chat and its title request at once: both wait on the same cold load, which
    is one load (one `model_load` decision, one entry in /api/models/loads), not two. Here both wait
    for ComfyUI's release first, so both are admitted by the same handoff."""
    demo = await box(slow_loads())
    assert demo.proxy is not None
    await run_prompt(proxy_of(demo).url("comfyui"), CKPT, http)  # the card is ComfyUI's: the chats join one release
    url = proxy_of(demo).url("ollama") + "/api/generate"
    answers = await asyncio.gather(*(http.post(url, json={"model": "gemma3:27b", "prompt": p, "stream": False})
                                     for p in ("a chat", "its title")))
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    loads = (await http.get(proxy_of(demo).url("admin") + "/api/models/loads")).json()["loads"]
    gemma = [x for x in loads if x["model"] == "gemma3:27b"]
    decisions = (await http.get(proxy_of(demo).url("admin") + "/api/decisions")).json()["decisions"]
    recorded = [d for d in decisions if d["kind"] == "model_load" and d["outcome"]["model"] == "gemma3:27b"]
    assert len(gemma) == 1 and len(recorded) == 1, f"one load recorded {len(gemma)} times: {gemma}"
