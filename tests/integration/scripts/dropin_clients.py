"""Run inside a network namespace of its own (the engines' real ports): `hyperswap install` into a temp
root, the simulated engines started where install moved them, the proxy from the written tenants.json,
then clients that know nothing of HyperSwap (the `ollama` library's default address, a browser's
ComfyUI address, its websocket); then `hyperswap uninstall`. Prints OK or raises."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from pathlib import Path

import httpx
import ollama
from websockets.asyncio.client import connect
from websockets.typing import Origin

from proxy.cli import build_parser
from proxy.deploy import install
from proxy.engines.loading import load_registry
from proxy.service import Proxy
from proxy.sim.box import SimBox, fast_scenario


class NoSystemctl:
    def run(self, argv: object) -> tuple[int, str]:
        return 0, ""


def deploy(action: str, root: Path) -> str:
    out = io.StringIO()
    rc = install.main(build_parser().parse_args([action, "--root", str(root)]), action, runner=NoSystemctl(), out=out)
    assert rc == 0, out.getvalue()
    return out.getvalue()


async def clients(config: Path, moved: dict[str, dict[str, str]]) -> None:
    box = SimBox(fast_scenario("default"))
    await box.start(ollama_port=int(moved["ollama"]["upstream"].rsplit(":", 1)[1]),
                    comfyui_port=int(moved["comfyui"]["upstream"].rsplit(":", 1)[1]))
    proxy = Proxy(load_registry(str(config)), box.gpu, watchdog_enabled=False)
    await proxy.start()
    try:
        assert proxy.servers["ollama"].url.endswith(":11434") and proxy.servers["comfyui"].url.endswith(":8188")
        # no host given: OLLAMA_HOST unset, so 127.0.0.1:11434 as the CLI uses
        async with ollama.AsyncClient() as client:
            names = [m.model for m in (await client.list()).models]
            assert "llama3.2:3b" in names, names
            answer = await client.generate(model="llama3.2:3b", prompt="hi", stream=False)
            assert answer.done and answer.response, answer
        async with httpx.AsyncClient(trust_env=False) as http:
            stats = await http.get("http://127.0.0.1:8188/system_stats", headers={"Origin": "http://127.0.0.1:8188"})
            assert stats.status_code == 200 and "devices" in stats.json(), stats.text
        async with connect("ws://127.0.0.1:8188/ws?clientId=dropin", origin=Origin("http://127.0.0.1:8188")) as ws:
            first = json.loads(await ws.recv())
            assert first["type"] == "status", first
    finally:
        await proxy.stop()
        await box.stop()


def main() -> None:
    root = Path(sys.argv[1])
    os.environ.pop("OLLAMA_HOST", None)
    deploy("install", root)  # nothing listens yet in this namespace: every port is free
    config = root / "etc/hyperswap/tenants.json"
    asyncio.run(clients(config, json.loads(config.read_text())["tenants"]))
    deploy("uninstall", root)
    assert not any(p.is_file() for p in root.rglob("*")), "uninstall left files"
    print("OK")


if __name__ == "__main__":
    main()
