"""A client that waits is told why (invariant 13, issue 36), on the demo box through the real
listeners: `Server-Timing` on every answer the proxy admitted after a wait; a streamed request that
waits answered at once with progress lines in its own protocol (the official `ollama` and `openai`
clients), then the engine's stream."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import ollama
import openai
import pytest

from proxy.demo import Demo, comfy_prompt
from proxy.tasks import poll_until
from tests.integration.boxes import (
    LOOPBACK_TLS,
    README_CKPT,
    DemoFactory,
    decisions,
    fast,
    proxy_of,
    render,
    succeeded,
    timings,
)

MODEL = "gemma3:27b"  # does not fit beside a loaded checkpoint: a chat for it waits for ComfyUI's release
MESSAGES = [{"role": "user", "content": "hi"}]


async def _render_running(demo: Demo, steps: int) -> asyncio.Future[list[dict[str, Any]]]:
    """A render whose job runs now (ComfyUI holds its checkpoint, and is busy)."""
    rendering = asyncio.ensure_future(render(demo, steps=steps))
    async with asyncio.timeout(5):
        await poll_until(lambda: proxy_of(demo).inflight.traffic("comfyui").jobs)
    return rendering


async def test_a_chat_that_waited_for_a_release_says_where_the_time_went(box: DemoFactory) -> None:
    demo = await box("default")
    assert succeeded(await render(demo))
    rendering = await _render_running(demo, 300)
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        r = await http.post(proxy_of(demo).url("ollama") + "/api/chat", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert r.status_code == 200, r.text
        assert rendering.done()
        phases = timings(r.headers.get("server-timing"))
        assert set(phases) == {"queue", "release"}, r.headers.get("server-timing")
        assert "comfyui" in phases["queue"][1] and "comfyui" in phases["release"][1], phases
        waited = next(d for d in reversed(decisions(demo, "queued")) if d.tenant == "ollama").outcome["waited_s"]
        total = phases["queue"][0] + phases["release"][0]
        assert abs(total - waited) < 0.05, f"queue + release = {total:.3f} s, the scheduler's wait {waited:.3f} s"

        again = await http.post(proxy_of(demo).url("ollama") + "/api/chat", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert again.status_code == 200 and "server-timing" not in again.headers, \
            f"a chat for a model on the card waited for nothing: {again.headers.get('server-timing')}"


async def test_a_streamed_chat_that_loads_its_model_without_progress_carries_the_load(box: DemoFactory) -> None:
    demo = await box("default")
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy_of(demo).url("ollama") + "/api/chat", headers={"X-HyperSwap-Progress": "off"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
            await r.aread()
    assert r.status_code == 200
    phases = timings(r.headers.get("server-timing"))
    assert set(phases) <= {"release", "load"} and "load" in phases, r.headers.get("server-timing")
    assert MODEL in phases["load"][1]


async def test_an_image_right_after_a_chat_names_the_hold_not_a_wait_for_ollama(box: DemoFactory) -> None:
    demo = await box(fast("default", settings={"proxy": {"swap_hold_s": 0.3}}))
    proxy = demo.proxy
    assert proxy is not None
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        chat = await http.post(proxy.url("ollama") + "/api/chat", json={"model": MODEL, "messages": MESSAGES,
                                                                        "stream": False})
        assert chat.status_code == 200, chat.text
        image = await http.post(proxy.url("comfyui") + "/prompt", json={"prompt": comfy_prompt(README_CKPT)})
        assert image.status_code == 200, image.text
    phases = timings(image.headers.get("server-timing"))
    assert "hold" in phases and "queue" not in phases, image.headers.get("server-timing")
    seconds, desc = phases["hold"]
    assert re.fullmatch(r"kept ollama \d\.\d s: used \d+\.\d s ago", desc), desc
    assert seconds > 0, phases
    async with asyncio.timeout(10):
        await poll_until(lambda: not proxy.inflight.traffic("comfyui").jobs)


# -- progress on the wire: streamed requests that wait are told why, in their own protocol ----------

async def _ollama_stream(base: str, headers: dict[str, str] | None = None) -> tuple[float, list[ollama.ChatResponse]]:
    """A streamed chat with the official client: seconds to its first part, and every part."""
    t0 = time.monotonic()
    first = None
    parts = []
    async with ollama.AsyncClient(host=base, verify=LOOPBACK_TLS, headers=headers or {}) as client:
        async for part in await client.chat(model=MODEL, messages=MESSAGES, stream=True):
            first = first if first is not None else time.monotonic() - t0
            parts.append(part)
    return first or 0.0, parts


async def _openai_stream(base: str) -> tuple[float, list[str], str]:
    """A streamed /v1 chat with the official client: seconds to its first chunk, the reasoning
    lines, the content."""
    t0 = time.monotonic()
    first = None
    thinking, content = [], ""
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                  http_client=openai.DefaultAsyncHttpxClient(verify=LOOPBACK_TLS, trust_env=False)) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        async for chunk in stream:
            first = first if first is not None else time.monotonic() - t0
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                if extra.get("reasoning_content"):
                    thinking.append(extra["reasoning_content"])
                content += choice.delta.content or ""
    return first or 0.0, thinking, content


def _in_order(lines: list[str], *wanted: str) -> bool:
    """Each wanted text appears in a line, after the line of the one before it."""
    at = 0
    for text in wanted:
        found = next((i for i in range(at, len(lines)) if text in lines[i]), None)
        if found is None:
            return False
        at = found + 1
    return True


async def test_a_streamed_ollama_chat_behind_a_render_hears_the_wait_release_and_load_first(box: DemoFactory) -> None:
    demo = await box("default")
    _, direct = await _ollama_stream(demo.box.servers["ollama"].url)
    assert succeeded(await render(demo))  # the checkpoint on the card: the chat's model no longer fits
    rendering = await _render_running(demo, 400)
    first, parts = await _ollama_stream(proxy_of(demo).url("ollama"))
    assert rendering.done() and succeeded(rendering.result())
    assert first < 1.0, f"the first bytes came after {first:.2f} s"
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    assert _in_order(thinking, "waiting for comfyui: 1 running job", "comfyui released:", f"loading {MODEL}"), thinking
    assert all(not p.done for p in parts if p.message.thinking)
    engine = [p for p in parts if not p.message.thinking]
    assert "".join(p.message.content or "" for p in engine) == "".join(p.message.content or "" for p in direct)
    assert [p.done for p in engine] == [p.done for p in direct] and engine[-1].done_reason == direct[-1].done_reason


async def test_a_streamed_v1_chat_behind_a_render_hears_the_wait_as_reasoning_content(box: DemoFactory) -> None:
    demo = await box(fast("default", ollama={"load_gbps": 10.0}))  # a load of about 1.7 s: its progress is read
    _, none, direct = await _openai_stream(demo.box.servers["ollama"].url)
    assert succeeded(await render(demo))
    rendering = await _render_running(demo, 400)
    first, thinking, content = await _openai_stream(proxy_of(demo).url("ollama"))
    assert rendering.done()
    assert first < 1.0, f"the first bytes came after {first:.2f} s"
    assert _in_order(thinking, "waiting for comfyui: 1 running job", "comfyui released:", f"loading {MODEL}",
                     "of 17.2 GiB, about", f"{MODEL} loaded in"), thinking
    assert not none and content == direct and content


async def test_a_cold_streamed_chat_with_nothing_to_wait_for_hears_its_load_first(box: DemoFactory) -> None:
    demo = await box(fast("default", ollama={"load_gbps": 8.0}))  # a load of about 2 s: its figures are read
    _, parts = await _ollama_stream(proxy_of(demo).url("ollama"))
    thinking = [p.message.thinking or "" for p in parts if p.message.thinking]
    assert thinking and thinking[0].startswith(f"loading {MODEL} ("), thinking
    assert _in_order(thinking, f"loading {MODEL} (", f"loading {MODEL}: ", f"{MODEL} loaded in"), thinking
    figure = next(line for line in thinking if line.startswith(f"loading {MODEL}: "))
    assert re.match(rf"loading {re.escape(MODEL)}: \d+\.\d of 17\.2 GiB, (about \d+ s left|taking longer)", figure), figure
    assert not any("queue" in t or "waiting" in t for t in thinking), "a load with nothing to wait for is no wait"
    assert parts[-1].done and "".join(p.message.content or "" for p in parts)
    assert not decisions(demo, "queued")


async def test_a_v1_chat_after_an_image_hears_the_reload_as_reasoning_content(box: DemoFactory) -> None:
    demo = await box(fast("default", ollama={"load_gbps": 10.0}))
    await _openai_stream(proxy_of(demo).url("ollama"))
    assert succeeded(await render(demo))  # the render released Ollama: the next chat only reloads
    _, thinking, content = await _openai_stream(proxy_of(demo).url("ollama"))
    assert _in_order(thinking, f"loading {MODEL}", f"{MODEL} loaded in"), thinking
    assert content


async def test_with_progress_off_a_waiting_stream_carries_the_engines_bytes_alone(box: DemoFactory) -> None:
    demo = await box(fast("default", tenants={"ollama": {"progress": "off"}}))
    assert succeeded(await render(demo))
    rendering = await _render_running(demo, 300)
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy_of(demo).url("ollama") + "/api/chat",
                               json={"model": MODEL, "messages": MESSAGES}) as r:
            body = await r.aread()
        assert rendering.done() and r.status_code == 200
        lines = [json.loads(line) for line in body.splitlines()]
        assert all("thinking" not in line["message"] for line in lines) and lines[-1]["done"], lines[:3]
        assert "queue" in timings(r.headers.get("server-timing")), "it did wait, silently"

        # ... and a request's header turns it back on
        rendering = await _render_running(demo, 300)
        _, parts = await _ollama_stream(proxy_of(demo).url("ollama"), {"X-HyperSwap-Progress": "on"})
        assert rendering.done() and any(p.message.thinking for p in parts)


async def test_a_stream_that_times_out_after_the_commit_ends_with_the_engines_error_shape(box: DemoFactory) -> None:
    demo = await box(fast("default", settings={"proxy": {"queue_timeout_s": 0.6}}))
    assert succeeded(await render(demo))
    rendering = await _render_running(demo, 1000)
    parts: list[ollama.ChatResponse] = []
    with pytest.raises(ollama.ResponseError) as err:
        async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
            async for part in await client.chat(model=MODEL, messages=MESSAGES, stream=True):
                parts.append(part)
    assert parts and "waiting for comfyui" in (parts[0].message.thinking or "")
    assert "waited 0.6 s for GPU memory" in str(err.value), err.value
    last = parts[-1].message.thinking or ""  # where Open WebUI shows it: it drops the error line itself
    assert last.startswith("failed: ") and "waited 0.6 s for GPU memory" in last and "fix" in last, last

    with pytest.raises(openai.APIError) as oerr:
        await _openai_stream(proxy_of(demo).url("ollama"))
    assert "waited 0.6 s for GPU memory" in str(oerr.value.message), oerr.value
    assert not rendering.done(), "both ended while the render still ran: no hang"
    await rendering


async def test_a_client_that_leaves_a_committed_stream_leaves_the_queue_and_counts_no_more(box: DemoFactory) -> None:
    demo = await box("default")
    proxy = demo.proxy
    assert proxy is not None and succeeded(await render(demo))
    rendering = await _render_running(demo, 400)
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy.url("ollama") + "/api/chat", json={"model": MODEL, "messages": MESSAGES}) as r:
            lines = r.aiter_lines()
            assert "waiting for comfyui" in json.loads(await anext(lines))["message"]["thinking"]
    async with asyncio.timeout(5):
        await poll_until(lambda: not proxy.broker.scheduler.waiting()
                         and proxy.inflight.traffic("ollama").connections == 0)
    assert proxy.inflight.traffic("ollama").in_flight == 0
    queued = next(d for d in reversed(decisions(demo, "queued")) if d.tenant == "ollama")
    assert queued.outcome["result"] == "client left while waiting"
    assert succeeded(await rendering)


async def test_a_load_is_recorded_when_the_client_leaves_its_streamed_answer_early(box: DemoFactory) -> None:
    demo = await box(fast("default", ollama={"load_gbps": 20.0, "token_rate": 5.0}))  # a slow answer to leave
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy_of(demo).url("ollama") + "/api/chat",
                               json={"model": MODEL, "messages": MESSAGES}) as r:
            async for line in r.aiter_lines():
                if not json.loads(line)["message"].get("thinking"):
                    break  # the engine's first token: the client stops reading and closes
    async with asyncio.timeout(10):
        await poll_until(lambda: decisions(demo, "model_load"))
    load = decisions(demo, "model_load")[-1]
    assert load.tenant == "ollama" and load.outcome["model"].startswith("gemma3") and load.outcome["seconds"] > 0, load


async def test_a_streamed_chat_for_a_model_the_engine_lacks_keeps_the_engines_404(box: DemoFactory) -> None:
    """A load is told once it takes a moment (`LOAD_GRACE_S`): an engine's quick refusal keeps its status,
    so a client that pulls a model on a 404 still can."""
    demo = await box("default")
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy_of(demo).url("ollama") + "/api/chat",
                               json={"model": "nope:1b", "messages": MESSAGES}) as r:
            body = await r.aread()
    assert r.status_code == 404 and b"thinking" not in body, (r.status_code, body)


async def test_a_load_whose_client_left_before_the_answer_is_timed_from_the_card(box: DemoFactory) -> None:
    demo = await box(fast("default", ollama={"load_gbps": 10.0}))  # a load of about 1.8 s: left half way
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", proxy_of(demo).url("ollama") + "/api/chat",
                               json={"model": MODEL, "messages": MESSAGES}) as r:
            first = json.loads(await anext(r.aiter_lines()))
    assert first["message"]["thinking"].startswith(f"loading {MODEL}"), first  # Stop while it loads
    async with asyncio.timeout(20):
        await poll_until(lambda: decisions(demo, "model_load"))
    load = decisions(demo, "model_load")[-1]
    assert load.outcome["source"] == "seen on the card (its client left before the answer)", load
    assert load.outcome["model"].startswith("gemma3") and load.outcome["seconds"] > 1.0, "faster than the sim loads"
