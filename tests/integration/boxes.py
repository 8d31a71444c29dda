"""Helpers for tests on the simulated box (shared with tests/browser through the root conftest)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.demo import Demo
from proxy.sim.box import fast_scenario as fast

ALL_PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
DemoFactory = Callable[..., Awaitable[Demo]]

__all__ = ["ALL_PORTS_ZERO", "DemoFactory", "fast"]
