"""A client that waits is told why (invariant 13, issue 36), on the demo box through the real
listeners: `Server-Timing` on every answer the proxy admitted after a wait."""

from __future__ import annotations

import asyncio
import re

import httpx
from boxes import LOOPBACK_TLS, DemoFactory, decisions, render, succeeded

from proxy.demo import Demo
from proxy.tasks import poll_until

MODEL = "gemma3:27b"  # does not fit beside a loaded checkpoint: a chat for it waits for ComfyUI's release
TIMING = re.compile(r'(\w+);dur=([\d.]+);desc="([^"]*)"')


def timings(header: str | None) -> dict[str, tuple[float, str]]:
    """name -> (seconds, desc) of a Server-Timing header."""
    return {m[1]: (float(m[2]) / 1000, m[3]) for m in TIMING.finditer(header or "")}


async def _render_running(demo: Demo, steps: int) -> asyncio.Future[object]:
    """A render whose job runs now (ComfyUI holds its checkpoint, and is busy)."""
    rendering = asyncio.ensure_future(render(demo, steps=steps))
    async with asyncio.timeout(5):
        await poll_until(lambda: demo.proxy.inflight.traffic("comfyui").jobs)  # type: ignore[union-attr]
    return rendering


async def test_a_chat_that_waited_for_a_release_says_where_the_time_went(box: DemoFactory) -> None:
    demo = await box("default")
    assert succeeded(await render(demo))
    rendering = await _render_running(demo, 300)
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        r = await http.post(demo.proxy.url("ollama") + "/api/chat", json={  # type: ignore[union-attr]
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert r.status_code == 200, r.text
        assert rendering.done()
        phases = timings(r.headers.get("server-timing"))
        assert set(phases) == {"queue", "release"}, r.headers.get("server-timing")
        assert "comfyui" in phases["queue"][1] and "comfyui" in phases["release"][1], phases
        waited = next(d for d in reversed(decisions(demo, "queued")) if d.tenant == "ollama").outcome["waited_s"]
        total = phases["queue"][0] + phases["release"][0]
        assert abs(total - waited) < 0.05, f"queue + release = {total:.3f} s, the scheduler's wait {waited:.3f} s"

        again = await http.post(demo.proxy.url("ollama") + "/api/chat", json={  # type: ignore[union-attr]
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert again.status_code == 200 and "server-timing" not in again.headers, \
            f"a chat for a model on the card waited for nothing: {again.headers.get('server-timing')}"


async def test_a_streamed_chat_that_loads_its_model_carries_the_load(box: DemoFactory) -> None:
    demo = await box("default")
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, trust_env=False, timeout=30) as http:
        async with http.stream("POST", demo.proxy.url("ollama") + "/api/chat", json={  # type: ignore[union-attr]
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
            await r.aread()
    assert r.status_code == 200
    phases = timings(r.headers.get("server-timing"))
    assert set(phases) <= {"release", "load"} and "load" in phases, r.headers.get("server-timing")
    assert MODEL in phases["load"][1]
