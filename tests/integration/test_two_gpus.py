"""Two simulated GPUs through the proxy (examples/scenarios/two-gpus.json): Ollama pinned to GPU 0
in tenants.json, ComfyUI found on GPU 1 by its `--cuda-device 1` flag. A load on one card never
releases the other card's tenant; a need too large for GPU 1 is refused with a 507 naming GPU 1,
though GPU 0 has the room."""

from __future__ import annotations

import httpx
import ollama

from proxy.demo import Demo, comfy_prompt, run_prompt
from tests.integration.boxes import LOOPBACK_TLS, DemoFactory, fast, proxy_of


async def test_a_load_on_gpu_1_releases_nothing_on_gpu_0(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("two-gpus")
    assert demo.proxy is not None
    admin = proxy_of(demo).url("admin")
    async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
        # Ollama fills most of GPU 0 with its largest model, through the proxy, with the official client
        answer = await client.generate(model="gemma3:27b", prompt="why is the sky blue?", stream=False)
        assert answer.done and answer.response
        # ComfyUI loads a 11.9 GiB checkpoint on GPU 1: on one 24 GiB card this would need Ollama's memory
        messages = await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
        assert "execution_success" in [m["type"] for m in messages]

        released = [r["tenant"] for d in (await http.get(f"{admin}/api/decisions")).json()["decisions"]
                    for r in (d["outcome"].get("releases") or [])]
        assert "ollama" not in released, f"a load on GPU 1 released Ollama on GPU 0: {released}"
        assert "gemma3:27b" in [m.model for m in (await client.ps()).models], "Ollama's model left GPU 0"

    tenants = {t["name"]: t for t in (await http.get(f"{admin}/api/tenants")).json()["tenants"]}
    assert tenants["ollama"]["devices"]["source"] == "pinned" and tenants["ollama"]["devices"]["devices"] == [0]
    comfy = tenants["comfyui"]["devices"]
    assert comfy["source"] == "discovered" and comfy["devices"] == [1] and "--cuda-device 1" in comfy["detail"]
    held = {d["index"]: d["vram_bytes"] for d in tenants["ollama"]["devices"]["vram_by_device"]}
    assert held[0] > 16 * 2**30 and held[1] == 0

    stats = (await http.get(f"{admin}/api/stats")).json()
    cards = stats["device"]["devices"]
    assert [c["index"] for c in cards] == [0, 1]
    assert set(cards[0]["tenants"]) >= {"ollama"} and "comfyui" not in cards[0]["tenants"]
    assert set(cards[1]["tenants"]) == {"comfyui"}

    plan = (await http.get(f"{admin}/api/plan", params={"tenant": "comfyui", "need_gb": 15})).json()["plan"]
    assert plan["device"]["index"] == 1 and plan["releases"] == [], plan["explanation"]

    metrics = (await http.get(f"{admin}/metrics")).text
    assert 'hyperswap_gpu_card_memory_total_bytes{index="1",name="Simulated RTX 4080"} 1.7179869184e+10' in metrics
    assert 'hyperswap_tenant_card_vram_bytes{index="1",tenant="comfyui"}' in metrics
    assert "hyperswap_gpu_memory_total_bytes 4.294967296e+10" in metrics, "the host's total is both cards"

    health = {e["name"]: e for e in (await http.get(f"{admin}/api/health")).json()["entries"]}
    assert health["gpu devices ollama"]["status"] == "ok" and "pinned" in health["gpu devices ollama"]["problem"]
    assert "--cuda-device 1" in health["gpu devices comfyui"]["problem"]


async def test_a_need_too_large_for_gpu_1_is_a_507_naming_gpu_1(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("two-gpus", comfyui={"checkpoints": {"huge.safetensors": 18.0}},
                          tenants={"comfyui": {"model_vram_gb": {"huge.safetensors": 18.0}},
                                   "ollama": {"devices": [5]}}))
    assert demo.proxy is not None
    r = await http.post(proxy_of(demo).url("comfyui") + "/prompt", json={"prompt": comfy_prompt("huge.safetensors")})
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["device"] == {"index": 1, "name": "Simulated RTX 4080", "uuid": "GPU-simulated-1"}
    assert body["plan"]["device"]["index"] == 1
    assert body["error"].startswith("not enough GPU memory for comfyui: GPU 1 (Simulated RTX 4080)"), body["error"]
    assert "fix" in body

    health = {e["name"]: e for e in (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()["entries"]}
    pin = health["gpu devices ollama"]
    assert pin["status"] == "degraded" and "no such device" in pin["problem"] and "tenants.ollama.devices" in pin["fix"]


async def _ollama_unmanaged_entry(demo: Demo, http: httpx.AsyncClient) -> dict[str, object]:
    body = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    return next(e for e in body["entries"] if e["name"] == "unmanaged VRAM (ollama)")


async def test_an_unmanaged_process_on_gpu_1_costs_ollama_on_gpu_0_nothing(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("two-gpus")
    demo.box.gpu.spawn("python", "python stt_relay.py --model large-v3", 15 * 2**30, device=1)
    e = await _ollama_unmanaged_entry(demo, http)
    # gemma3:27b (16.2 GiB) fits GPU 0's 23.7 usable GiB whatever GPU 1 holds
    assert e["status"] == "ok", e
    assert "stt_relay.py" not in str(e["problem"]), "a process on GPU 1 was counted against GPU 0"


async def test_an_unmanaged_process_on_gpu_0_is_named_with_its_card(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("two-gpus")
    demo.box.gpu.spawn("python", "python stt_relay.py --model large-v3", 8 * 2**30, device=0)
    e = await _ollama_unmanaged_entry(demo, http)
    assert e["status"] == "degraded", e
    assert "GPU 0" in str(e["problem"]) and "stt_relay.py" in str(e["problem"]), e
    assert "gemma3:27b" in str(e["impact"]), e
