"""The user's sequences on the simulated box, with the official `ollama` client and a websocket
ComfyUI client: chat and image generation alternating on one card, as issue 12 names them."""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import httpx
import ollama
import pytest

from proxy.config.units import GIB
from proxy.tasks import poll_until
from tests.integration.boxes import (
    LOOPBACK_TLS,
    DemoFactory,
    chat,
    comfyui_of,
    decisions,
    fast,
    ollama_of,
    proxy_of,
    releases,
    render,
    succeeded,
)


async def test_a_prompt_sent_after_a_chat_takes_the_idle_chat_models_memory(box: DemoFactory) -> None:
    demo = await box("default")
    assert (await chat(demo, "gemma3:27b")).message.content
    msgs = await render(demo)
    assert succeeded(msgs), [m["type"] for m in msgs]
    assert releases(demo) == [("comfyui", "ollama")], "the idle, higher-priority Ollama gave its memory to ComfyUI"


async def test_a_chat_sent_while_the_readme_prompt_renders_waits_and_is_answered(box: DemoFactory) -> None:
    demo = await box("default")
    assert succeeded(await render(demo))  # ComfyUI holds its checkpoint, as after the README's first line
    rendering = asyncio.ensure_future(render(demo, steps=400))
    async with asyncio.timeout(5):
        await poll_until(lambda: proxy_of(demo).inflight.traffic("comfyui").jobs)
    answer = await chat(demo, "gemma3:27b")
    assert answer.message.content and rendering.done(), "the chat was answered after the render ended"
    assert succeeded(rendering.result())
    queued = decisions(demo, "queued")
    assert queued and queued[-1].tenant == "ollama" and queued[-1].outcome["result"] == "admitted"
    assert not decisions(demo, "rejection")


async def test_three_rounds_of_chat_then_image_complete_with_no_error(box: DemoFactory) -> None:
    demo = await box("default")
    for _ in range(3):
        assert (await chat(demo, "gemma3:27b")).message.content
        assert succeeded(await render(demo, "flux1-dev-fp8.safetensors"))
    assert releases(demo) == [("comfyui", "ollama"), ("ollama", "comfyui")] * 2 + [("comfyui", "ollama")]
    assert not decisions(demo, "rejection", "oom_retry")


async def test_a_release_asked_right_after_the_end_marker_is_not_refused_as_busy(box: DemoFactory) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    rendering = asyncio.ensure_future(render(demo, steps=300))
    async with asyncio.timeout(5):
        await poll_until(lambda: demo.box.gpu.used_by(comfyui_of(demo).pid or 0) >= 6 * GIB)
    await proxy_of(demo).watchdog.tick() # reads ComfyUI's /queue with the prompt running
    await rendering
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        r = await http.post(admin + "/api/tenants/comfyui/release")
    assert r.status_code == 200, r.text
    assert r.json()["confirmed"] is True


async def test_no_spill_is_seen_while_a_model_is_still_loading(box: DemoFactory) -> None:
    sc = fast("default", ollama={"load_gbps": 10.0}, settings={"proxy": {"watchdog_interval_s": 0.05}})
    demo = await box(sc, watchdog=True)
    assert succeeded(await render(demo))
    assert (await chat(demo, "gemma3:27b")).message.content  # ~1.7 s of loading, the watchdog polling /api/ps
    assert not decisions(demo, "spill", "rejection"), [d.outcome for d in decisions(demo, "spill", "rejection")]
    assert releases(demo) == [("ollama", "comfyui")]


async def test_an_unload_releases_nobody_and_is_never_refused(box: DemoFactory) -> None:
    demo = await box("tight")  # the speech relay makes the biggest model impossible to load here
    async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
        for model in ("mistral-small:22b", "llama3.1:8b"):
            done = await client.generate(model=model, keep_alive=0)
            assert done.done_reason == "unload"
            done = await client.chat(model=model, messages=[], keep_alive="0s")
            assert done.done_reason == "unload"
    assert not releases(demo) and not decisions(demo, "rejection", "queued", "plan")


async def test_an_unload_through_the_proxy_leaves_an_idle_comfyui_alone(box: DemoFactory) -> None:
    demo = await box("default")
    assert succeeded(await render(demo, "flux1-dev-fp8.safetensors"))
    async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
        await client.generate(model="gemma3:27b", keep_alive=0)
    assert comfyui_of(demo).frees == 0 and not releases(demo)


async def test_an_impossible_need_still_answers_507_at_once(box: DemoFactory) -> None:
    demo = await box("tight")
    with pytest.raises(ollama.ResponseError) as err:
        await chat(demo, "mistral-small:22b")
    assert err.value.status_code == 507
    assert "stt_relay.py" in str(err.value) or "unmanaged" in str(err.value)
    assert not decisions(demo, "queued"), "refused without waiting"


async def test_two_clients_alternating_do_not_swap_the_card_when_both_fit(box: DemoFactory) -> None:
    demo = await box("default")
    for _ in range(3):
        assert (await chat(demo, "llama3.1:8b")).message.content
        assert succeeded(await render(demo))
    assert releases(demo) == [] and comfyui_of(demo).frees == 0
    assert list(ollama_of(demo).loaded()) == ["llama3.1:8b"]


async def test_a_request_for_a_model_already_on_the_card_skips_the_gpu_read(
        box: DemoFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = await box("default")
    broker = proxy_of(demo).broker
    assert (await chat(demo, "llama3.2:3b")).message.content
    reads = 0
    read = broker.card_reader.read

    async def counting() -> Any:
        nonlocal reads
        reads += 1
        return await read()
    monkeypatch.setattr(broker.card_reader, "read", counting)
    for _ in range(3):
        assert (await chat(demo, "llama3.2:3b")).message.content
    assert reads == 0, "a resident model needs no plan"
    assert (await chat(demo, "llama3.1:8b")).message.content
    assert reads >= 1, "a model that is not on the card is planned for"


async def test_once_ollama_was_seen_holding_the_chat_model_an_idle_comfyui_that_fits_beside_it_stays(
        box: DemoFactory) -> None:
    # gemma3:27b takes 16.2 GiB on the card, ComfyUI's idle checkpoint 6.9 GiB: both fit on 24 GiB.
    # Its file plus the context allowance (17.2 GiB) did not, so every chat released ComfyUI and the
    # next render reloaded its checkpoint (bench/mixed.py: CRRC 12.6 s against the oracle's 9.3 s)
    demo = await box("default")
    assert succeeded(await render(demo))
    assert (await chat(demo, "gemma3:27b")).message.content  # first load: the allowance, ComfyUI released
    await proxy_of(demo).watchdog.tick() # reads /api/ps with gemma3:27b loaded
    assert succeeded(await render(demo))  # the render's configured need takes the card: Ollama released
    assert (await chat(demo, "gemma3:27b")).message.content
    assert releases(demo) == [("ollama", "comfyui"), ("comfyui", "ollama")], \
        f"the idle ComfyUI was released again: {releases(demo)} "


@pytest.mark.parametrize("replay_body_max_mb", [1.0, 0.0])
async def test_a_chat_whose_body_is_too_large_to_keep_is_planned_like_any_other(
        box: DemoFactory, replay_body_max_mb: float) -> None:
    """Issue 40 item 1 (one door): a chat with big images (over replay_body_max_mb, or any body with 0)
    was streamed without admission: with flux idle on the card, Ollama loaded gemma3:27b beside it and
    spilled it to the CPU. Planned on the model its body's head names, it releases ComfyUI first; only
    the OOM retry is given up, and its decision says so."""
    demo = await box(fast("default", tenants={"ollama": {"replay_body_max_mb": replay_body_max_mb}}))
    assert succeeded(await render(demo, "flux1-dev-fp8.safetensors"))  # flux idle on the card
    image = base64.b64encode(os.urandom(3 * 2**20)).decode()  # a photo: 4 MiB of base64
    body = {"model": "gemma3:27b", "messages": [{"role": "user", "content": "what is this?", "images": [image]}],
            "stream": False}
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        r = await http.post(proxy_of(demo).url("ollama") + "/api/chat", json=body)
        assert r.status_code == 200, r.text
        ps = (await http.get(proxy_of(demo).url("ollama") + "/api/ps")).json()["models"]
    assert releases(demo) == [("ollama", "comfyui")], "ComfyUI's idle flux was released for the chat"
    (plan,) = [d for d in decisions(demo, "plan") if d.tenant == "ollama"]
    assert "no OOM retry" in plan.trigger, plan.trigger
    (gemma,) = [m for m in ps if m["name"] == "gemma3:27b"]
    assert gemma["size_vram"] == gemma["size"], f"gemma3:27b is split between the card and the CPU: {gemma}"
