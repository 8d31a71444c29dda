"""Release kind `cuda_suspend` on the demo box (issue 43): ComfyUI and Ollama hand the card over by
suspension into host RAM, so a render after a chat reads no checkpoint again; a request that arrives
during the suspend waits for it and the restore; host RAM short falls back to the next release step."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from proxy.demo import Demo
from proxy.lifecycle.suspender import Suspensions
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, chat, comfyui_of, decisions, fast, proxy_of, render, succeeded

CKPT = "sd_xl_base_1.0.safetensors"
CHAT = "qwen2.5:14b"  # 9 GiB: does not fit beside the loaded checkpoint on the 16 GiB card
WITHIN_S = 20.0  # a hang fails the test, never stalls it


def state_of(suspensions: Suspensions, tenant: str) -> str:
    """The tenant's suspension state (it must have a record)."""
    record = suspensions.record(tenant)
    assert record is not None, f"no suspension record for {tenant}"
    return record.state


def steps_of(demo: Demo, tenant: str) -> list[list[str]]:
    """For each release of `tenant` so far: the kinds of the steps it tried, with their results."""
    out = []
    for d in decisions(demo, "plan"):
        for r in d.outcome.get("releases", []):
            if r["tenant"] == tenant:
                out.append([f"{s['kind']}:{s['result']}" for s in r.get("steps", [])] or [str(r.get("asked"))])
    return out


async def admin(http: httpx.AsyncClient, demo: Demo, path: str) -> Any:
    assert demo.proxy is not None
    r = await http.get(proxy_of(demo).url("admin") + path)
    assert r.status_code == 200, r.text
    return r.json()


async def test_render_chat_render_swaps_by_suspension_and_reads_no_checkpoint_again(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("suspend"))
    assert demo.proxy is not None and demo.box.comfyui is not None
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        assert (await chat(demo, CHAT)).message.content
        parked = (await admin(http, demo, "/api/gpu"))["host_ram"]
        assert [p["tenant"] for p in parked["parked"]] == ["comfyui"] and parked["parked_bytes"] > 6 * 2**30, parked
        tenants = {t["name"]: t for t in (await admin(http, demo, "/api/tenants"))["tenants"]}
        assert tenants["comfyui"]["suspension"]["state"] == "suspended", tenants["comfyui"]["suspension"]
        assert succeeded(await render(demo, CKPT))
    assert comfyui_of(demo).checkpoint_loads == 1, "the render after the chat read its checkpoint again"
    released = [r for d in decisions(demo, "plan") for r in d.outcome.get("releases", [])]
    assert any(r["tenant"] == "comfyui" and "suspended" in r["asked"] for r in released), released
    restores = [d.outcome for d in decisions(demo, "resume") if d.tenant == "comfyui"]
    assert restores and restores[-1]["ok"] and restores[-1]["asked"]["restored"], restores
    assert demo.box.checkpointer.restores >= 1
    health = {e["name"]: e for e in (await admin(http, demo, "/api/health"))["entries"]}
    assert health["suspend comfyui"]["status"] == "ok", health["suspend comfyui"]


async def test_a_render_sent_during_comfyuis_suspend_waits_for_it_then_for_the_restore(box: DemoFactory) -> None:
    demo = await box(fast("suspend", suspend={"copy_gbps": 10.0}))  # ~0.7 s to park the checkpoint
    assert demo.proxy is not None and demo.box.comfyui is not None
    suspensions = proxy_of(demo).broker.lifecycles.suspensions
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        chatting = asyncio.create_task(chat(demo, CHAT))
        await poll_until(lambda: state_of(suspensions, "comfyui") == "suspending")
        rendering = asyncio.create_task(render(demo, CKPT))
        assert (await chatting).message.content
        assert succeeded(await rendering)
    assert state_of(suspensions, "comfyui") == "running"
    assert comfyui_of(demo).checkpoint_loads == 1
    assert [d.outcome["ok"] for d in decisions(demo, "resume") if d.tenant == "comfyui"][-1:] == [True]


async def test_host_ram_too_small_falls_back_to_the_next_release_step(box: DemoFactory) -> None:
    demo = await box(fast("suspend", suspend={"host_ram_gb": 8.0}))  # 6.9 GiB + the 4 GiB margin do not fit
    assert demo.proxy is not None and demo.box.comfyui is not None
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        assert (await chat(demo, CHAT)).message.content
        assert succeeded(await render(demo, CKPT))
    assert steps_of(demo, "comfyui")[0] == ["cuda_suspend:error", "comfyui_free:confirmed"], steps_of(demo, "comfyui")
    first = next(r for d in decisions(demo, "plan") for r in d.outcome.get("releases", []) if r["tenant"] == "comfyui")
    assert "host RAM short" in first["steps"][0]["error"], first
    assert comfyui_of(demo).checkpoint_loads == 2, "freed by /free: the checkpoint is read again"


async def test_an_engine_process_that_exits_while_suspended_is_forwarded_to_and_says_so(box: DemoFactory) -> None:
    """Ollama's runner parked by the render's handoff, then gone (its process ended): the next chat is
    forwarded at once (Ollama's server answers for itself), the state says why, nothing hangs."""
    demo = await box(fast("suspend"))
    assert demo.proxy is not None
    suspensions = proxy_of(demo).broker.lifecycles.suspensions
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        assert (await chat(demo, CHAT)).message.content
        assert succeeded(await render(demo, CKPT))
        parked = suspensions.record("ollama")
        assert parked is not None
        (runner,) = [pid for pid in demo.box.gpu.parked() if pid in parked.pids]
        demo.box.gpu.kill(runner)
        assert (await chat(demo, CHAT)).message.content
    rec = suspensions.record("ollama")
    assert rec is not None and rec.state == "failed" and "exited while suspended" in (rec.error or ""), rec
    last = next(d.outcome for d in decisions(demo, "resume") if d.tenant == "ollama")  # the newest
    assert last["ok"] is False and last["asked"]["fallback"].startswith("forwarded"), last


async def test_the_proxys_stop_restores_what_it_suspended_where_the_card_has_room(box: DemoFactory) -> None:
    """Left suspended, an app's CUDA calls would block for ever with no proxy to restore it; one the card
    has no room for stays suspended (a restore without room fails) and is named with its command."""
    demo = await box(fast("suspend"))
    assert demo.proxy is not None and demo.box.ollama is not None
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        assert (await chat(demo, CHAT)).message.content  # ComfyUI parked; Ollama's 9 GiB on the card: no room
        assert demo.box.gpu.parked(), "nothing was suspended"
        ollama = demo.box.ollama
        async with httpx.AsyncClient(trust_env=False) as direct:  # Ollama lets go of the card by itself
            await direct.post(demo.box.servers["ollama"].url + "/api/generate", json={"model": CHAT, "keep_alive": 0})
        await ollama.wait_until(lambda: not ollama.loaded())
        await proxy_of(demo).broker.aclose()
        assert demo.box.gpu.parked() == {}, "room for it, and it is still suspended"


async def test_an_app_the_card_has_no_room_for_stays_suspended_at_the_stop(
        box: DemoFactory, caplog: pytest.LogCaptureFixture) -> None:
    demo = await box(fast("suspend"))
    assert demo.proxy is not None
    async with asyncio.timeout(WITHIN_S):
        assert succeeded(await render(demo, CKPT))
        assert (await chat(demo, CHAT)).message.content
        await proxy_of(demo).broker.aclose()
    assert demo.box.gpu.parked(), "restored without room (Ollama's 9 GiB and ComfyUI's 6.9 do not fit 16)"
    assert "comfyui stays suspended at the proxy's stop" in caplog.text and "cuda-checkpoint --toggle --pid" in caplog.text
