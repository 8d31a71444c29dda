"""Progress on the wire during an app's start (issue 36): a streamed chat to an Ollama-shaped app the
proxy starts on demand is answered at once, hears "starting <tenant>" and then that it started, and
then gets the app's own stream, through the official `ollama` client."""

from __future__ import annotations

import sys
from pathlib import Path

import ollama
import pytest

from tests.integration.boxes import LOOPBACK_TLS, DemoFactory, fast, free_port, proxy_of

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tiny_ollama.py"


def tiny_ollama(port: int) -> dict[str, object]:
    """An Ollama-engine tenant whose app (tests/integration/scripts/tiny_ollama.py) the proxy starts."""
    return {
        "engine": "ollama",
        "listen": f"127.0.0.1:{free_port()}",
        "upstream": f"http://127.0.0.1:{port}",
        "match": {"process_names": [], "cmdline_patterns": [f"tiny_ollama.py {port}"]},
        "priority": 40,
        "needs_vram_gb": 1.0,
        "model_vram_gb": {"tiny:1b": 1.0},
        "start_timeout_s": 20,
        "release": {"kind": "process", "stop_timeout_s": 2, "command": [sys.executable, str(SCRIPT), str(port)]},
    }


async def _chat(base: str, headers: dict[str, str] | None = None) -> list[ollama.ChatResponse]:
    async with ollama.AsyncClient(host=base, verify=LOOPBACK_TLS, headers=headers or {}) as client:
        return [part async for part in await client.chat(model="tiny:1b", messages=[{"role": "user", "content": "hi"}],
                                                          stream=True)]


async def test_a_streamed_chat_to_a_stopped_app_hears_it_start_then_gets_the_apps_stream(box: DemoFactory) -> None:
    demo = await box(fast("default", tenants={"tiny": tiny_ollama(free_port())}))
    assert demo.proxy is not None
    machine = proxy_of(demo).broker.lifecycles.machine("tiny")
    assert machine is not None and machine.state == "stopped"
    parts = await _chat(proxy_of(demo).url("tiny"))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    assert len(thinking) >= 2 and thinking[0].startswith("starting tiny"), thinking
    assert any(line.startswith("tiny started in ") for line in thinking[1:]), thinking
    content = "".join(p.message.content or "" for p in parts if not p.message.thinking)
    assert content == "hello from the app" and parts[-1].done, [p.model_dump() for p in parts]
    assert machine.state == "running"


async def test_with_progress_off_a_chat_that_starts_its_app_carries_the_apps_bytes_alone(box: DemoFactory) -> None:
    demo = await box(fast("default", tenants={"tiny": tiny_ollama(free_port())}))
    assert demo.proxy is not None
    parts = await _chat(proxy_of(demo).url("tiny"), {"X-HyperSwap-Progress": "off"})
    assert not any(p.message.thinking for p in parts), [p.model_dump() for p in parts]
    assert "".join(p.message.content or "" for p in parts) == "hello from the app"


async def test_a_start_that_fails_after_the_commit_ends_the_stream_with_ollamas_error_line(box: DemoFactory) -> None:
    tenant = tiny_ollama(free_port())
    script = "import sys; print('error: out of memory', file=sys.stderr); sys.exit(3)"
    tenant["release"] = {"kind": "process", "command": [sys.executable, "-c", script]}
    demo = await box(fast("default", tenants={"tiny": tenant}))
    assert demo.proxy is not None
    with pytest.raises(ollama.ResponseError) as failed:
        await _chat(proxy_of(demo).url("tiny"))
    assert "could not be started" in str(failed.value), str(failed.value)
