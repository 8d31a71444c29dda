"""Helpers for tests on the simulated box: shipped scenarios with delays cut to milliseconds."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from proxy.demo import Demo
from proxy.sim.box import Scenario, load_scenario

ALL_PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}


def fast(name: str, **changes: Any) -> Scenario:
    """A shipped scenario with delays cut so tests take milliseconds, plus changes per section."""
    data = load_scenario(name).model_dump()
    data["ollama"].update({"load_gbps": 200.0, "unload_delay_s": 0.15, "token_rate": 2000.0})
    data["comfyui"].update({"free_delay_s": 0.15, "load_gbps": 200.0, "step_time_s": 0.002})
    for section, values in changes.items():
        if isinstance(data.get(section), dict):
            data[section].update(values)
        else:
            data[section] = values
    return Scenario.model_validate(data)


DemoFactory = Callable[..., Awaitable[Demo]]
