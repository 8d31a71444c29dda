"""Helpers for tests on the simulated box (shared with tests/browser through the root conftest)."""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from proxy.demo import Demo
from proxy.sim.box import fast_scenario as fast
from proxy.tls import client_context

ALL_PORTS_ZERO = {"ollama": 0, "comfyui": 0, "admin": 0, "stt": 0}
DemoFactory = Callable[..., Awaitable[Demo]]
# For every test client (verify=LOOPBACK_TLS): httpx's default reads the CA bundle again for each
# client, 60-140 ms here, and the suite builds hundreds of them (they all speak plain HTTP anyway).
LOOPBACK_TLS = client_context()



def _ephemeral() -> range:
    """The ports the kernel hands out for port 0 (every other test binds those)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port() -> int:
    """A loopback port free now, for an app the proxy starts (its command needs the number, so it
    cannot bind port 0 itself). Drawn outside the kernel's ephemeral range: a port 0 bind elsewhere
    in the suite can never take it between this check and the app's own bind."""
    ephemeral = _ephemeral()
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: another test's app, or the machine's
            return port
    raise RuntimeError("no free loopback port found in 20000-32000")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def process_tenant(port: int, folder: Path, **extra: object) -> dict[str, object]:
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


__all__ = ["ALL_PORTS_ZERO", "LOOPBACK_TLS", "DemoFactory", "fast", "free_port", "port_open", "process_tenant"]
