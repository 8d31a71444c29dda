"""`hyperswap check --ready-within S`: the service's start gate (the unit's ExecStartPost).

systemd runs ExecStartPost right after starting `hyperswap serve`, before the listeners are up, so
the gate waits for the admin API to answer. Once it answers, the start succeeded: the health
report goes to the journal, and a dependency that is down (ComfyUI not started yet) is not a
reason to stop the proxy. A proxy that never answers fails the start (exit 2), and `Restart=`
takes over.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from proxy.admin.address import admin_base_url
from proxy.admin.health import check_main
from proxy.errors import HyperSwapError


def wait_answering(url: str, within_s: float, *, get: Callable[[str], int] | None = None,
                   sleep: Callable[[float], None] = time.sleep, now: Callable[[], float] = time.monotonic) -> bool:
    """Poll `url` until it answers at all (any status), for at most `within_s` seconds."""
    def probe(u: str) -> int:
        return httpx.get(u, timeout=2.0, trust_env=False).status_code

    get = get or probe
    deadline = now() + within_s
    while True:
        try:
            get(url)
            return True
        except httpx.HTTPError:
            pass
        if now() >= deadline:
            return False
        sleep(0.25)


def ready_gate(config: str | None, admin_url: str | None, as_json: bool, within_s: float) -> int:
    try:
        base = admin_base_url(config, admin_url)
    except HyperSwapError as exc:
        print(exc.one_line())
        return exc.exit_code
    if not wait_answering(base + "/api/health", within_s):
        print(f"error: no HyperSwap proxy answered at {base} within {within_s:g} s "
              "(fix: journalctl -u hyperswap says why it did not start)")
        return 2
    rc = check_main(config, admin_url, as_json)
    return 0 if rc == 1 else rc  # a failed dependency is reported, not fatal to the service
