"""Helpers for tests on the simulated box (shared with tests/browser through the root conftest)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import ollama
from websockets.asyncio.client import connect as ws_connect

from proxy.demo import Demo, comfy_prompt
from proxy.lifecycle.process import ProcessController
from proxy.service import Proxy
from proxy.sim.box import fast_scenario as fast
from proxy.sim.comfyui import ComfySim
from proxy.sim.ollama import OllamaSim
from proxy.sim.ports import loose_port
from proxy.tasks import poll_until
from proxy.tls import client_context

ALL_PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
DemoFactory = Callable[..., Awaitable[Demo]]
# For every test client (verify=LOOPBACK_TLS): httpx's default reads the CA bundle again for each
# client, 60-140 ms here, and the suite builds hundreds of them (they all speak plain HTTP anyway).
LOOPBACK_TLS = client_context()
README_CKPT = "sd_xl_base_1.0.safetensors"  # examples/comfy_prompt.json


SERVER_TIMING = re.compile(r'(\w+);dur=([\d.]+);desc="([^"]*)"')


def timings(header: str | None) -> dict[str, tuple[float, str]]:
    """name -> (seconds, desc) of a Server-Timing header (proxy/relay/trace.py writes it)."""
    return {m[1]: (float(m[2]) / 1000, m[3]) for m in SERVER_TIMING.finditer(header or "")}


def free_port() -> int:
    """A loopback port free now, for an app the proxy starts (its command needs the number, so it
    cannot bind port 0 itself). Drawn outside the kernel's ephemeral range (`proxy.sim.ports`): a port
    0 bind elsewhere in the suite can never take it between this check and the app's own bind."""
    return loose_port("127.0.0.1")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def process_tenant(port: int, folder: Path, **extra: object) -> dict[str, Any]:
    """A generic tenant whose app is Python's own HTTP server on `port`, run and owned by the proxy
    (release kind `process`), serving `folder` (with a hello.txt). A file server only answers reads,
    so a read starts it (`wake_on: "any"`; the default, "writes", keeps reads from starting an app)."""
    (folder / "hello.txt").write_text("hello from the app\n")
    return {
        "engine": "generic",
        "listen": f"127.0.0.1:{free_port()}",
        "upstream": f"http://127.0.0.1:{port}",
        "match": {"process_names": [], "cmdline_patterns": [f"http.server {port}"]},
        "priority": 30,
        "needs_vram_gb": 1.0,
        "wake_on": "any",
        "release": {"kind": "process", "stop_timeout_s": 2,
                    "command": [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                "--directory", str(folder)]},
        **extra,
    }


async def stranger_on(port: int, folder: Path) -> asyncio.subprocess.Process:
    """A server the proxy did not start (Python's own file server) holding `port`, once it answers."""
    stranger = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(20):
        await poll_until(lambda: port_open(port))
    return stranger


# -- the user's clients on the demo box: the official `ollama` client, a websocket ComfyUI client --

def decisions(demo: Demo, *kinds: str) -> list[Any]:
    return [d for d in proxy_of(demo).decisions.recent(500) if d.kind in kinds]


def releases(demo: Demo) -> list[tuple[str, str]]:
    """(requester, released tenant) of every handoff so far."""
    return [(d.tenant, r["tenant"]) for d in decisions(demo, "plan", "oom_retry", "spill")
            for r in d.outcome.get("releases", [])]


async def chat(demo: Demo, model: str) -> ollama.ChatResponse:
    async with ollama.AsyncClient(host=proxy_of(demo).url("ollama"), verify=LOOPBACK_TLS) as client:
        reply: ollama.ChatResponse = await client.chat(model=model, messages=[{"role": "user", "content": "hi"}])
        return reply


class RenderRefused(Exception):
    """POST /prompt answered something other than 200 (the proxy's 503 or 507, or ComfyUI's 400)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"POST /prompt answered {status}: {text}")
        self.status = status


async def render(demo: Demo, ckpt: str = README_CKPT, steps: int | None = None) -> list[dict[str, Any]]:
    """A prompt through the proxy with its websocket open, up to the end marker. A fresh seed, as real
    clients send (a repeated graph is cached by ComfyUI: it loads and samples nothing, hiding its cost)."""
    base = proxy_of(demo).url("comfyui")
    cid = uuid.uuid4().hex
    prompt = comfy_prompt(ckpt, seed=random.randrange(2**40))
    if steps:
        prompt["3"]["inputs"]["steps"] = steps
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=30, trust_env=False) as http:
        async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}", max_size=None) as ws:
            await ws.recv()
            r = await http.post(base + "/prompt", json={"prompt": prompt, "client_id": cid})
            if r.status_code != 200:
                raise RenderRefused(r.status_code, r.text)
            msgs: list[dict[str, Any]] = []
            async with asyncio.timeout(30):
                while not msgs or not (msgs[-1]["type"] == "executing" and msgs[-1]["data"]["node"] is None):
                    raw = await ws.recv()
                    if isinstance(raw, str):
                        msgs.append(json.loads(raw))
    return msgs


def proxy_of(demo: Demo) -> Proxy:
    """The demo's proxy: every box the tests start has one (`Demo.proxy` is None only for `demo --no-proxy`)."""
    assert demo.proxy is not None, "this demo was started without the proxy"
    return demo.proxy


def ollama_of(demo: Demo) -> OllamaSim:
    """The box's simulated Ollama (None only in a scenario without one)."""
    assert demo.box.ollama is not None, "this scenario has no Ollama"
    return demo.box.ollama


def comfyui_of(demo: Demo) -> ComfySim:
    """The box's simulated ComfyUI (None only in a scenario without one)."""
    assert demo.box.comfyui is not None, "this scenario has no ComfyUI"
    return demo.box.comfyui


def app_process(demo: Demo, name: str = "app") -> ProcessController:
    """The controller of a tenant the proxy runs as a process (release kind `process`)."""
    machine = proxy_of(demo).broker.lifecycles.machine(name)
    assert machine is not None, f"{name} has no lifecycle"
    assert isinstance(machine.controller, ProcessController), machine.controller
    return machine.controller


class FixedSystemctl:
    """The `systemctl show` runner of `EnvReaders`, answering fixed output and writing down each call;
    None: systemctl is not installed (a container)."""

    def __init__(self, text: str | None) -> None:
        self.text = text
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if self.text is None:
            raise FileNotFoundError("systemctl")
        return self.text


def never_short(demo: Demo) -> list[str]:
    """Every allocation the simulated card could not grant so far (an engine's OOM, a load spilled to
    the CPU): planning kept the card from over-committing when this is empty."""
    return list(demo.box.gpu.shortfalls)


def succeeded(msgs: list[dict[str, Any]]) -> bool:
    return "execution_success" in [m["type"] for m in msgs] and "execution_error" not in [m["type"] for m in msgs]


__all__ = [
    "ALL_PORTS_ZERO",
    "LOOPBACK_TLS",
    "README_CKPT",
    "DemoFactory",
    "FixedSystemctl",
    "RenderRefused",
    "app_process",
    "chat",
    "comfyui_of",
    "decisions",
    "fast",
    "free_port",
    "never_short",
    "ollama_of",
    "port_open",
    "process_tenant",
    "proxy_of",
    "releases",
    "render",
    "stranger_on",
    "succeeded",
]
