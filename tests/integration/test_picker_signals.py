"""The signals a cluster's endpoint picker scrapes (issue 35), moved one by one on the demo box through the
real listeners: a request running, a model loading then on the card, a busy tenant raising the memory cost,
a request waiting in the handoff queue, and a job waiting in the engine's own queue. Each is read from
`/metrics` and compared with what the scheduler holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo import Demo
from proxy.handoff.residency import slot
from proxy.tasks import cancel_and_wait, poll_until
from tests.integration.boxes import DemoFactory, chat, comfyui_of, fast, proxy_of, render, succeeded

FLUX = "flux1-dev-fp8.safetensors"
# Millisecond engines, but an Ollama load slow enough (4.9 GB at 20 GB/s: a quarter second) to be seen on its
# way, and renders of a few hundred steps (2 ms each) long enough to be seen running.
# The watchdog reads the card every 0.1 s: the cost is as of the last reading.
BOX = fast("default", ollama={"load_gbps": 20.0, "unload_delay_s": 0.3}, comfyui={"free_delay_s": 0.2},
           settings={"proxy": {"watchdog_interval_s": 0.1}})


class Signals:
    def __init__(self, text: str) -> None:
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, tenant: str) -> float | None:
        found = [s.value for s in self.samples if s.name == name and s.labels.get("tenant") == tenant]
        assert len(found) <= 1, f"{name}{{tenant={tenant}}} has {len(found)} samples"
        return found[0] if found else None

    def models(self, tenant: str) -> dict[str, str]:
        (labels,) = [s.labels for s in self.samples
                     if s.name == "hyperswap_tenant_models_info" and s.labels["tenant"] == tenant]
        return labels

    def waiting(self, tenant: str) -> float | None:
        return self.value("hyperswap_tenant_requests_waiting", tenant)

    def running(self, tenant: str) -> float | None:
        return self.value("hyperswap_tenant_requests_running", tenant)

    def cost(self, tenant: str) -> float | None:
        return self.value("hyperswap_tenant_memory_cost", tenant)


async def scrape(http: httpx.AsyncClient, demo: Demo) -> Signals:
    r = await http.get(proxy_of(demo).url("admin") + "/metrics")
    assert r.status_code == 200, r.text
    return Signals(r.text)


async def until(http: httpx.AsyncClient, demo: Demo, check: Callable[[Signals], bool], failure: str) -> Signals:
    seen: list[Signals] = []

    async def met() -> bool:
        seen.append(await scrape(http, demo))
        return check(seen[-1])

    try:
        async with asyncio.timeout(5):
            await poll_until(met)
    except TimeoutError:
        raise AssertionError(failure) from None
    return seen[-1]


def queue_of(demo: Demo, tenant: str) -> int:
    return sum(1 for w in proxy_of(demo).broker.scheduler.waiting() if w["tenant"] == tenant)


async def test_each_picker_signal_moves_with_the_scheduler_on_the_demo_box(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(BOX, watchdog=True)
    first = await scrape(http, demo)
    for tenant in ("ollama", "comfyui"):
        assert first.waiting(tenant) == 0 and first.running(tenant) == 0, f"{tenant}: nothing sent yet"
        assert first.models(tenant)["running_lora_adapters"] == "" and first.models(tenant)["max_lora"] == "0"
    assert first.cost("ollama") == 0.25, "an empty card: a load into free memory"

    assert succeeded(await render(demo, FLUX))  # ComfyUI keeps flux on the card, idle
    # the cost is as of the last card reading (the watchdog reads the card every tick)
    # (a render's promise stands until a reading taken after its end: the first readings may still count it)
    idle = await until(http, demo, lambda s: 0.25 < (s.cost("ollama") or 0) < 0.5,
                       "flux idle on the card never showed in the cost as part free, part idle")
    assert idle.running("comfyui") == 0
    cost_idle = idle.cost("ollama")
    assert cost_idle is not None and cost_idle < 0.5, f"{cost_idle}: part of what Ollama could reach is free, part idle"

    # a model on its way to the card, its request running; then on the card
    chatting = asyncio.create_task(chat(demo, "llama3.1:8b"))
    loading = await until(http, demo, lambda s: "llama3.1:8b" in s.models("ollama")["waiting_lora_adapters"],
                          "llama3.1:8b was never listed on its way to the card")
    assert loading.running("ollama") == 1, "the admitted chat is running"
    assert loading.models("ollama")["max_lora"] == "1"
    await chatting
    loaded = await scrape(http, demo)
    assert loaded.models("ollama")["running_lora_adapters"] == "llama3.1:8b"
    assert loaded.models("ollama")["waiting_lora_adapters"] == ""
    assert loaded.running("ollama") == 0
    resident, on_the_way = proxy_of(demo).broker.scheduler.loads_of("ollama")
    assert [slot(key) for key in resident] == ["ollama:llama3.1:8b"] and on_the_way == ()  # its variant: digest, options

    # a busy tenant raises the cost; a second render waits in ComfyUI's own queue; a chat that needs the
    # render's memory waits in the handoff queue
    renders = [asyncio.create_task(render(demo, FLUX, steps=200)) for _ in range(2)]
    busy = await until(http, demo, lambda s: s.waiting("comfyui") == 1 and s.running("comfyui") == 1,
                       "two renders: one running, one waiting in ComfyUI's queue")
    cost_busy = busy.cost("ollama")
    assert cost_busy is not None and cost_busy > cost_idle, f"busy {cost_busy} should cost more than idle {cost_idle}"
    waiter = asyncio.create_task(chat(demo, "gemma3:27b"))  # 16.2 GB: only with flux off the card
    queued = await until(http, demo, lambda s: s.waiting("ollama") == 1, "the big chat never showed as waiting")
    assert queue_of(demo, "ollama") == 1, "the gauge counts the scheduler's own waiter"
    assert queued.running("ollama") == 0, "a waiting request is not running"

    await cancel_and_wait([waiter])  # the client leaves the queue: no 16 GB load to wait for here
    for msgs in await asyncio.gather(*renders):
        assert succeeded(msgs)
    end = await until(http, demo, lambda s: s.waiting("ollama") == 0 and s.waiting("comfyui") == 0
                      and s.running("comfyui") == 0, "the queues never emptied")
    assert end.models("ollama")["running_lora_adapters"] == "llama3.1:8b"


async def test_the_models_gauge_lists_the_checkpoint_comfyui_renders_with(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(BOX, watchdog=True)
    rendering = asyncio.create_task(render(demo, FLUX, steps=400))
    busy = await until(http, demo, lambda s: s.running("comfyui") == 1, "the render never showed as running")
    await until(http, demo, lambda s: s.running("comfyui") == 1 and comfyui_of(demo).loaded() != {},
                "flux never reached the card")
    during = [await scrape(http, demo) for _ in range(3)]
    assert succeeded(await rendering)
    for s in [busy, *during]:
        if s.running("comfyui") == 1:
            listed = s.models("comfyui")
            assert FLUX in listed["running_lora_adapters"] + listed["waiting_lora_adapters"], listed
