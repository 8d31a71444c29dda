"""Fixtures: a whole simulated box with the proxy in front, on port 0, fast delays."""

from __future__ import annotations

from typing import Any, AsyncIterator

import httpx
import pytest
from boxes import ALL_PORTS_ZERO, DemoFactory, fast

from proxy.demo import Demo, start_demo
from proxy.sim.box import Scenario

@pytest.fixture
async def box() -> AsyncIterator[DemoFactory]:
    started: list[Demo] = []

    async def make(scenario: str | Scenario = "default", **kw: Any) -> Demo:
        sc = fast(scenario) if isinstance(scenario, str) else scenario
        demo = await start_demo(sc, sim_ports={"ollama": 0, "comfyui": 0}, proxy_ports=ALL_PORTS_ZERO,
                                watchdog=kw.pop("watchdog", False), **kw)
        started.append(demo)
        return demo

    yield make
    for demo in started:
        await demo.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        yield client
