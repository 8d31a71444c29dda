"""Helpers for tests on the simulated box (shared with tests/browser through the root conftest)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.demo import Demo
from proxy.sim.box import fast_scenario as fast
from proxy.tls import client_context

ALL_PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
DemoFactory = Callable[..., Awaitable[Demo]]
# For every test client (verify=LOOPBACK_TLS): httpx's default reads the CA bundle again for each
# client, 60-140 ms here, and the suite builds hundreds of them (they all speak plain HTTP anyway).
LOOPBACK_TLS = client_context()

__all__ = ["ALL_PORTS_ZERO", "LOOPBACK_TLS", "DemoFactory", "fast"]
