"""`python -m docs.gen.screenshot`: the dashboard screenshot of the README and the site, taken on the demo.

The default scenario on free ports (so a running `hyperswap demo` is left alone), the getting-started
page's first handoff through the proxy (a ComfyUI render, then Ollama asking for gemma3:27b, which
releases ComfyUI), then the dashboard in the browser tests' Chromium (Debian's /usr/bin/chromium,
driven by Playwright, with tests/browser/conftest.py's arguments and environment), written to
docs/assets/dashboard.png. Needs the `test` extra and Chromium; takes about half a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx
from playwright.async_api import async_playwright

from docs.gen import DOCS
from proxy.demo import Demo, start_demo
from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS, chromium_env

OUT = DOCS / "assets" / "dashboard.png"
PROMPT = DOCS.parent / "examples" / "comfy_prompt.json"
VIEWPORT = {"width": 1280, "height": 860}
SCALE = 0.75


async def first_handoff(demo: Demo) -> None:
    """A render that leaves ComfyUI holding its checkpoint, then a chat whose model needs that memory."""
    assert demo.proxy is not None
    comfy, ollama = demo.proxy.url("comfyui"), demo.proxy.url("ollama")
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as http:
        r = await http.post(f"{comfy}/prompt", content=PROMPT.read_bytes())
        r.raise_for_status()
        prompt_id = r.json()["prompt_id"]
        for _ in range(600):
            if prompt_id in (await http.get(f"{comfy}/history/{prompt_id}")).json():
                break
            await asyncio.sleep(0.1)
        r = await http.post(f"{ollama}/api/generate",
                            json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
        r.raise_for_status()


async def take(out: Path, home: Path) -> None:
    # A fresh history: the demo's telemetry file is per user, and other demos' minutes would show in the chart.
    os.environ["XDG_STATE_HOME"] = str(home / "state")
    os.environ.pop("HYPERSWAP_TELEMETRY", None)
    demo = await start_demo("default", sim_ports={"ollama": 0, "comfyui": 0},
                            proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0})
    try:
        assert demo.proxy is not None
        pw = await async_playwright().start()
        try:
            env: dict[str, str | float | bool] = {**chromium_env(home)}
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, env=env)
            # The whole page (memory, tenants, history, settings, model files, decisions) at 3/4 scale: small.
            page = await browser.new_page(viewport=VIEWPORT, device_scale_factor=SCALE)  # type: ignore[arg-type]
            await page.goto(demo.proxy.url("admin") + "/")
            await page.wait_for_selector('#membar [data-segment="comfyui"]', state="attached", timeout=30_000)
            await first_handoff(demo)
            await page.wait_for_selector('#membar [data-segment="ollama"]', state="attached", timeout=30_000)
            await asyncio.sleep(2.5)  # two stats frames: the bar and the decision log settle
            out.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(out), type="png", full_page=True)
            await browser.close()
        finally:
            await pw.stop()
    finally:
        await demo.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.gen.screenshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the PNG (default: {OUT})")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        asyncio.run(take(args.out, Path(home)))
    print(json.dumps({"wrote": str(args.out), "bytes": args.out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
