"""A port for an app that binds it later (the speech relay the proxy starts on demand): drawn outside
the kernel's ephemeral range, so no port-0 bind or outgoing connection on the machine takes it in the
meantime. A port picked by binding 0 and letting go was taken by another test's client socket in a
CI run (`test_polling_reads_never_make_a_stopped_app_flap`: "port ... already in use by pid ...").
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

SPARE = range(20000, 32000)  # below Linux's default ephemeral range (32768-60999)


def ephemeral_range() -> range:
    """The ports the kernel hands out for port 0 and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def loose_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range, for an app that binds it later."""
    ephemeral = ephemeral_range()
    for _ in range(200):
        port = random.randrange(SPARE.start, SPARE.stop)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # taken: another app's, or the machine's
            return port
    raise RuntimeError(f"no free port found on {host} in {SPARE.start}-{SPARE.stop - 1}")
