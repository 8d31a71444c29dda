"""The engines' control calls (release, /api/ps, /queue, /system_stats, /api/tags), answered by respx:
the calls the proxy makes are asserted as sent, no socket is opened. Shapes from the wire facts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx

from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.engines import ReleaseFailed
from proxy.engines.loading import registry_from_dict
from proxy.engines.ollama_catalog import OllamaCatalog
from proxy.engines.registry import adapter_for

OLLAMA = "http://127.0.0.1:11434"
COMFYUI = "http://127.0.0.1:28188"
HOST_RAM = int(24.04 * GIB)


def stats(device: dict[str, Any]) -> dict[str, Any]:
    return {"system": {"comfyui_version": "0.8.0", "argv": ["main.py"]}, "devices": [device]}


CPU = stats({"name": "cpu", "type": "cpu", "index": None, "vram_total": int(23.54 * GIB), "vram_free": 20 * GIB,
             "torch_vram_total": HOST_RAM, "torch_vram_free": 20 * GIB})
CUDA = stats({"name": "cuda:0 NVIDIA GeForce RTX 4090 : cudaMallocAsync", "type": "cuda", "index": 0,
              "vram_total": 24 * GIB, "vram_free": 18 * GIB, "torch_vram_total": 5 * GIB, "torch_vram_free": GIB})


def tenant(name: str, **body: Any) -> Tenant:
    upstream = {"ollama": OLLAMA, "comfyui": COMFYUI}.get(name, "http://127.0.0.1:9000")
    return registry_from_dict({"tenants": {name: {"upstream": upstream, **body}}}).get(name)


def ps_model(name: str, size_vram: int) -> dict[str, Any]:
    return {"name": name, "model": name, "size": size_vram, "size_vram": size_vram,
            "expires_at": "2026-12-03T12:00:00.123456789Z"}


@pytest.fixture
def engine() -> Iterator[respx.MockRouter]:
    """Every control call the test makes must be one it set an answer for, and each must be made."""
    with respx.mock(assert_all_called=True, assert_all_mocked=True) as router:
        yield router


@pytest.fixture
async def client() -> Any:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def sent_json(route: respx.Route) -> list[Any]:
    return [json.loads(call.request.content) for call in route.calls]


# -- release ----------------------------------------------------------------------------------------

async def test_ollama_release_unloads_every_loaded_model_with_keep_alive_0(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").respond(json={"models": [ps_model("gemma3:27b", 17 * GIB),
                                                            ps_model("llama3.2:latest", 3 * GIB)]})
    unload = engine.post(f"{OLLAMA}/api/generate").respond(json={"model": "x", "done": True, "done_reason": "unload"})
    asked = await adapter_for(tenant("ollama")).release(client)
    assert asked == {"call": "keep_alive 0", "models": ["gemma3:27b", "llama3.2:latest"]}
    assert sent_json(unload) == [{"model": "gemma3:27b", "keep_alive": 0}, {"model": "llama3.2:latest", "keep_alive": 0}]


async def test_ollama_with_nothing_loaded_is_asked_nothing_more(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").respond(json={"models": []})
    # No route for /api/generate: an unload sent anyway would fail as an unmocked call.
    assert await adapter_for(tenant("ollama")).release(client) == {"call": "keep_alive 0", "models": []}
    assert len(engine.calls) == 1


async def test_ollama_refusing_an_unload_fails_the_release_and_names_the_model(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").respond(json={"models": [ps_model("gemma3:27b", 17 * GIB)]})
    engine.post(f"{OLLAMA}/api/generate").respond(500, json={"error": "model is busy"})
    with pytest.raises(ReleaseFailed, match=r"refused to unload gemma3:27b: 500"):
        await adapter_for(tenant("ollama")).release(client)


async def test_comfyui_release_posts_free_with_the_tenants_flags(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    free = engine.post(f"{COMFYUI}/free").respond(200)
    asked = await adapter_for(tenant("comfyui", release={"kind": "comfyui_free", "unload_models": False})).release(client)
    assert sent_json(free) == [{"unload_models": False, "free_memory": True}]
    assert asked == {"call": "POST /free", "unload_models": False, "free_memory": True}


async def test_comfyui_refusing_free_fails_the_release(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.post(f"{COMFYUI}/free").respond(405)
    with pytest.raises(ReleaseFailed, match=r"ComfyUI refused /free: 405"):
        await adapter_for(tenant("comfyui")).release(client)


async def test_an_engine_that_cannot_be_reached_fails_the_release_naming_it(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").mock(side_effect=httpx.ConnectError("connection refused"))
    with pytest.raises(ReleaseFailed, match=rf"cannot reach ollama at {OLLAMA}: connection refused"):
        await adapter_for(tenant("ollama")).release(client)


async def test_an_http_release_on_a_path_calls_the_upstream_with_its_method_and_body(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    call = engine.delete("http://127.0.0.1:9000/models/loaded").respond(204)
    spec = {"kind": "http", "method": "DELETE", "url": "/models/loaded", "body": {"all": True}}
    asked = await adapter_for(tenant("stt", release=spec)).release(client)
    assert asked == {"call": "DELETE http://127.0.0.1:9000/models/loaded", "status": 204}
    assert sent_json(call) == [{"all": True}]


async def test_an_http_release_answered_with_an_error_fails(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.post("http://127.0.0.1:9000/unload").respond(503)
    with pytest.raises(ReleaseFailed, match=r"answered 503"):
        await adapter_for(tenant("stt", release={"kind": "http", "url": "/unload"})).release(client)


async def test_a_tenant_that_cannot_release_is_refused_without_a_call(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    desktop = registry_from_dict({}).get("desktop")
    with pytest.raises(ReleaseFailed, match="display server"):
        await adapter_for(desktop).release(client)
    assert not engine.calls, "nothing to call"


# -- what the engine says about itself ----------------------------------------------------------------

async def test_ollama_ps_keeps_the_named_models_and_drops_malformed_entries(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    good = ps_model("llama3.2:latest", 3 * GIB)
    engine.get(f"{OLLAMA}/api/ps").respond(json={"models": [good, {"size": 1}, "junk", {"name": 7}]})
    assert await adapter_for(tenant("ollama")).placements(client) == [good]


async def test_ollama_ps_that_fails_raises_for_the_caller(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").respond(500)
    with pytest.raises(httpx.HTTPStatusError):
        await adapter_for(tenant("ollama")).placements(client)


async def test_comfyui_running_prompts_are_the_ids_of_the_running_queue_items(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    # Each item is [number, prompt_id, graph, extra_data, outputs]; pending ones are not running.
    engine.get(f"{COMFYUI}/queue").respond(json={
        "queue_running": [[3, "b1f0", {}, {"client_id": "abc"}, ["9"]], ["short"]],
        "queue_pending": [[4, "c2e1", {}, {}, ["9"]]]})
    assert await adapter_for(tenant("comfyui")).running_jobs(client) == ["b1f0"]


async def test_ollama_self_report_is_the_sum_of_size_vram(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").respond(json={"models": [ps_model("a:latest", 2 * GIB), ps_model("b:latest", GIB)]})
    assert await adapter_for(tenant("ollama")).self_reported_bytes(client) == 3 * GIB


async def test_an_unreachable_engine_reports_unknown_not_zero(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{OLLAMA}/api/ps").mock(side_effect=httpx.ConnectError("connection refused"))
    assert await adapter_for(tenant("ollama")).self_reported_bytes(client) is None


async def test_the_catalog_reads_tags_once_and_again_for_a_name_it_does_not_know(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    tags = engine.get(f"{OLLAMA}/api/tags")
    tags.side_effect = [httpx.Response(200, json={"models": [{"name": "llama3.2:latest", "size": 2 * GIB}]}),
                        httpx.Response(200, json={"models": [{"name": "llama3.2:latest", "size": 2 * GIB},
                                                             {"name": "phi3:mini", "size": GIB}]})]
    catalog = OllamaCatalog()
    assert await catalog.size_of(tenant("ollama"), client, "llama3.2") == 2 * GIB
    assert await catalog.size_of(tenant("ollama"), client, "llama3.2:latest") == 2 * GIB
    assert tags.call_count == 1, "a known name is not looked up again"
    assert await catalog.size_of(tenant("ollama"), client, "phi3:mini") == GIB, "pulled since: found on a refresh"
    assert tags.call_count == 2


# -- ComfyUI's /system_stats (wire facts B.5) ---------------------------------------------------------

async def test_a_cpu_comfyui_holds_no_vram_and_reports_no_card(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{COMFYUI}/system_stats").respond(json=CPU)
    comfyui = tenant("comfyui")
    assert await adapter_for(comfyui).self_reported_bytes(client) == 0, "torch_vram_total is host RAM on the CPU"
    assert await adapter_for(comfyui).device_report(client) is None, "host RAM is not a card"
    assert await adapter_for(comfyui).runs_on_cpu(client) is True


async def test_a_cuda_comfyui_reports_its_card_and_what_torch_holds(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{COMFYUI}/system_stats").respond(json=CUDA)
    comfyui = tenant("comfyui")
    assert await adapter_for(comfyui).self_reported_bytes(client) == 5 * GIB + comfyui.idle_vram_bytes
    device = await adapter_for(comfyui).device_report(client)
    assert device is not None and device.total_bytes == 24 * GIB and device.figure("free") == 18 * GIB
    assert device.figure("reserved") is None, "cudaMemGetInfo has no driver-reserved figure"
    assert await adapter_for(comfyui).runs_on_cpu(client) is False


async def test_unreadable_system_stats_are_unknown(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    engine.get(f"{COMFYUI}/system_stats").respond(200, text="<html>not json</html>")
    comfyui = tenant("comfyui")
    assert await adapter_for(comfyui).self_reported_bytes(client) is None
    assert await adapter_for(comfyui).device_report(client) is None
