"""Shared fixtures. Every test is kept away from the operator's real configuration."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point HOME (so ~/.config/hyperswap and ~/.local/state/hyperswap) at an empty folder and drop
    HYPERSWAP_* variables, so no test can read or write the operator's live tenants.json."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    for var in ("HYPERSWAP_CONFIG", "HYPERSWAP_ADMIN_TOKEN", "HYPERSWAP_TELEMETRY"):
        monkeypatch.delenv(var, raising=False)
    # Loopback only: never let a client pick up a proxy from the environment.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return home


@pytest.fixture(autouse=True)
def _no_real_gpu_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML settings writer is the one way the proxy changes a card (power limit, clocks, fans):
    under the tests it raises instead of loading the real NVML, so no test can touch a card.
    Tests of its call mapping inject a fake pynvml; everything else replaces the writer."""
    from proxy.gpu.settings_writer import NvmlSettingsWriter, RealWriterBlocked

    def blocked() -> None:
        raise RealWriterBlocked("a test reached the real NVML settings writer: inject a fake pynvml or a recorder")

    monkeypatch.setattr(NvmlSettingsWriter, "_real_nvml", staticmethod(blocked))


def _open_descriptors() -> set[tuple[str, str]] | None:
    """(descriptor, what it points at) for each open descriptor; None where /proc is not there."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    found = set()
    for name in names:
        with contextlib.suppress(OSError):  # closed meanwhile (listdir's own)
            found.add((name, os.readlink(f"/proc/self/fd/{name}")))
    return found


@pytest.fixture(autouse=True)
def _unclosed_sockets_fail_their_own_test() -> Iterator[None]:
    """A socket or transport nobody closed is found by the garbage collector, whenever it runs,
    and its ResourceWarning (an error here) would land on whichever test runs then. Collecting
    when a test ends with a descriptor open that it did not find pins it on the test that leaked
    it (one still held by a captured log record's traceback fails the next test instead). Only
    then: a collection after every test cost 0.1 to 1.5 s each on 2 cores; this check ~0.1 ms."""
    before = _open_descriptors()
    yield
    after = _open_descriptors()
    if before is not None and after is not None and after - before:
        gc.collect()


@asynccontextmanager
async def started_boxes() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start whole simulated boxes (GPU, both engines, the proxy) on port 0 with fast delays:
    `demo = await make("tight")` or `await make(fast_scenario(...))`; all stopped on exit."""
    from proxy.demo import Demo, start_demo
    from proxy.sim.box import Scenario, fast_scenario

    started: list[Demo] = []

    async def make(scenario: str | Scenario = "default", **kw: Any) -> Demo:
        sc = fast_scenario(scenario) if isinstance(scenario, str) else scenario
        ports = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
        demo = await start_demo(sc, sim_ports={"ollama": 0, "comfyui": 0, "relay": 0}, proxy_ports=ports,
                                watchdog=kw.pop("watchdog", False), **kw)
        started.append(demo)
        return demo

    yield make
    # Together: each demo's listeners drain at once (one after another cost a test ~0.6 s per box).
    outcomes = await asyncio.gather(*(demo.stop() for demo in started), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


@pytest.fixture
async def box() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Simulated boxes for this test, on its own event loop (see `started_boxes`); all stopped at teardown."""
    async with started_boxes() as make:
        yield make


@pytest_asyncio.fixture(loop_scope="session")
async def box_on_the_session_loop() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """The same, still one set per test and stopped at its teardown, but on the worker's shared event
    loop: for tests that run there to share a long-lived resource (tests/browser's Chromium)."""
    async with started_boxes() as make:
        yield make
