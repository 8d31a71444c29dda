"""Issue 40's footprint sequences on the simulated box (24 GiB card, Ollama and ComfyUI), through the
proxy with the official `ollama` client: another num_ctx is another load, a spill is learned and
the split model reloaded whole, a name copied over is planned as its new model, and what the proxy
learned outlives a restart. The Ollama simulator reloads a runner whose options or content differ
and sizes its KV cache by num_ctx, as Ollama does (wire facts A.11)."""

from __future__ import annotations

from typing import Any

import httpx
import ollama

from proxy.clock import ManualClock
from proxy.config.units import GIB
from proxy.demo import Demo
from tests.integration.boxes import LOOPBACK_TLS, DemoFactory, decisions, fast, proxy_of, releases, render, succeeded

BIG_CTX = {"num_ctx": 65536}


async def chat(demo: Demo, model: str, **options: Any) -> ollama.ChatResponse:
    async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
        answer: ollama.ChatResponse = await client.chat(model=model, messages=[{"role": "user", "content": "hi"}],
                                                        options=options or None)
        return answer


async def loaded(demo: Demo) -> list[dict[str, Any]]:
    """Ollama's own /api/ps, asked directly."""
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False) as http:
        models: list[dict[str, Any]] = (await http.get(demo.box.servers["ollama"].url + "/api/ps")).json()["models"]
        return models


async def need(demo: Demo, model: str, **options: Any) -> tuple[int, str]:
    """What the proxy would plan for a chat (its adapter's estimate, the same call the gate makes)."""
    proxy = demo.proxy
    assert proxy is not None
    tenant = proxy.registry.get("ollama")
    body = httpx.Request("POST", "/", json={"model": model, "messages": [], "options": options}).content
    n = await proxy.forwarder.adapter(tenant).estimate_need("/api/chat", body, proxy.broker.control)
    return n.bytes, n.key


async def test_another_num_ctx_is_planned_apart_and_a_split_model_is_reloaded_whole(box: DemoFactory) -> None:
    """A num_ctx 65536 chat while the default load is on the card is never admitted as "on the card";
    its first load spills (nothing has shown its size yet), which the proxy learns; spill relief
    frees ComfyUI and unloads the split model while Ollama is idle, so the next such chat loads it
    whole; the default chat afterwards is planned on its own footprint, not the big one."""
    clock = ManualClock(ticking=True)
    demo = await box(fast("default", settings={"proxy": {"spill_stable_s": 30.0}}), clock=clock)
    proxy = demo.proxy
    assert proxy is not None
    assert (await chat(demo, "qwen2.5:14b")).message.content
    assert succeeded(await render(demo))  # SDXL stays beside it, idle
    await proxy.watchdog.tick()  # Ollama's /api/ps: the default load is on the card
    default_bytes, default_key = await need(demo, "qwen2.5:14b")
    big_key = (await need(demo, "qwen2.5:14b", **BIG_CTX))[1]
    scheduler = proxy.broker.scheduler
    assert scheduler.resident("ollama", default_key) and not scheduler.resident("ollama", big_key), \
        "a request with another num_ctx was taken for the load on the card (Ollama reloads it)"

    assert (await chat(demo, "qwen2.5:14b", **BIG_CTX)).message.content
    (split,) = await loaded(demo)
    assert split["context_length"] == 65536 and split["size_vram"] < split["size"], "precondition: it spilled"
    await proxy.watchdog.tick()
    await clock.advance(31.0)  # the split held still past spill_stable_s
    report = await proxy.watchdog.tick()
    assert releases(demo)[-1] == ("ollama", "comfyui"), report.reasons
    assert "load it whole" in report.reasons["ollama"] or "loads it whole" in report.reasons["ollama"], report.reasons
    assert not await loaded(demo), "the split model was left split"
    assert (await need(demo, "qwen2.5:14b", **BIG_CTX))[0] >= split["size"], "the spill was not learned"

    assert (await chat(demo, "qwen2.5:14b", **BIG_CTX)).message.content
    (whole,) = await loaded(demo)
    assert whole["size_vram"] == whole["size"] == split["size"], whole
    assert (await need(demo, "qwen2.5:14b"))[0] == default_bytes < split["size"], \
        "the default chat was planned on the num_ctx 65536 footprint"


async def test_a_name_copied_over_through_the_proxy_is_planned_as_the_model_it_now_is(box: DemoFactory) -> None:
    """The issue's sequence: `/api/copy` passed through untouched and the copied model was planned at
    the old name's size, so it loaded beside an idle flux and spilled (16.2 GiB with 11.25 on the card)."""
    demo = await box("default")
    proxy = demo.proxy
    assert proxy is not None
    assert (await chat(demo, "llama3.2:3b")).message.content
    await proxy.watchdog.tick()  # learns llama3.2:3b's footprint (2 GiB)
    assert succeeded(await render(demo, "flux1-dev-fp8.safetensors"))  # flux idle beside it
    await proxy.watchdog.tick()
    async with ollama.AsyncClient(host=proxy.url("ollama"), verify=LOOPBACK_TLS) as client:
        await client.copy("gemma3:27b", "llama3.2:3b")
    assert (await chat(demo, "llama3.2:3b")).message.content
    (row,) = await loaded(demo)
    assert row["size"] >= 16 * GIB and row["size_vram"] == row["size"], f"the copied model spilled: {row}"
    assert releases(demo)[-1] == ("ollama", "comfyui")


async def test_footprints_learned_before_a_restart_plan_the_first_request_after_it(box: DemoFactory) -> None:
    """The issue's sequence: after every restart the first request was planned on the file size (plus
    the allowance) and released an idle ComfyUI the card could keep beside it."""
    first = await box("default")
    assert first.proxy is not None
    assert (await chat(first, "gemma3:27b")).message.content
    await first.proxy.watchdog.tick()  # Ollama showed gemma3:27b whole: 16.2 GiB, kept in the state folder
    learned = await need(first, "gemma3:27b")
    await first.stop()

    again = await box("default")  # a new proxy (same state folder), a new Ollama with nothing loaded
    assert await need(again, "gemma3:27b") == learned
    assert learned[0] < int(16.2 * GIB) + GIB, "planned on the file plus the allowance"
    assert succeeded(await render(again))
    assert (await chat(again, "gemma3:27b")).message.content
    assert releases(again) == [], "ComfyUI's idle SDXL was released for a model that fits beside it"
    assert not decisions(again, "rejection", "oom_retry")
