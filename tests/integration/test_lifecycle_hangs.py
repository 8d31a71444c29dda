"""Nothing hangs (issue 33, item 3): a controller call that never returns (a `systemctl` that hangs,
a Docker daemon that accepts and never answers) is bounded by its timeout and killed, the request
that waited for the start is answered within start_timeout_s plus a small margin with a real error
text, and no process of it is left behind (health checks included)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from proxy.lifecycle import docker
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, fast, free_port, proxy_of

START_TIMEOUT_S = 1.0
MARGIN_S = 1.5  # WAKE_SLACK_S (1 s) and a loaded machine's scheduling


def running_with(marker: str) -> list[int]:
    """The pids whose command line names `marker` (the fake's processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def hanging_systemctl(folder: Path, marker: str) -> None:
    """A `systemctl` on PATH that answers `is-active` (inactive) and hangs on everything else, with a
    child of its own that hangs too (a wrapper script's): both name `marker` on their command line."""
    script = folder / "systemctl"
    script.write_text(f"""#!{sys.executable}
import signal, subprocess, sys
if "is-active" in sys.argv:
    print("inactive")
    sys.exit(3)
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", "{marker}"])
signal.pause()
""")
    script.chmod(0o755)


def systemd_tenant() -> dict[str, object]:
    port = free_port()
    return {"engine": "generic", "listen": f"127.0.0.1:{free_port()}", "upstream": f"http://127.0.0.1:{port}",
            "match": {"process_names": [], "cmdline_patterns": [f"never-{port}"]}, "needs_vram_gb": 1.0,
            "release": {"kind": "systemd", "unit": "hang.service"}, "release_timeout_s": 1.0,
            "start_timeout_s": START_TIMEOUT_S}


async def answered_in(http: httpx.AsyncClient, url: str) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    async with asyncio.timeout(START_TIMEOUT_S + 30):  # a hang fails the test, never stalls the suite
        r = await http.post(url, content=b"")
    return r, time.monotonic() - began


async def test_a_hanging_systemctl_is_killed_and_the_request_answered_within_start_timeout(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"hyperswap-hang-{uuid.uuid4().hex}"
    hanging_systemctl(tmp_path, marker)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    demo = await box(fast("default", tenants={"unit": systemd_tenant()}))
    assert demo.proxy is not None

    r, took = await answered_in(http, proxy_of(demo).url("unit") + "/work")
    assert r.status_code == 503 and took < START_TIMEOUT_S + MARGIN_S, (r.status_code, took, r.text)
    error = r.json()["error"]
    assert "hang.service` did not finish within 1 s and was killed" in error, error  # its start, or the stop after it
    async with asyncio.timeout(10):  # the failed start's stop hangs too, until its own timeout (1 s)
        await poll_until(lambda: not running_with(marker))

    health = await http.get(proxy_of(demo).url("admin") + "/api/health")  # `systemctl show` hangs past the check's timeout
    assert health.status_code in (200, 503)
    async with asyncio.timeout(10):
        await poll_until(lambda: not running_with(marker))
    assert not running_with(marker), "a systemctl of a health check was left behind"


@pytest.fixture
async def silent_docker(tmp_path: Path) -> AsyncIterator[Path]:
    """A Docker socket whose daemon accepts every connection and never says a word."""
    path = tmp_path / "docker.sock"
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_unix_server(silent, path=str(path))
    try:
        yield path
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_docker_socket_that_never_answers_is_answered_within_start_timeout_with_the_reason(
        box: DemoFactory, http: httpx.AsyncClient, silent_docker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker, "STATUS_TIMEOUT_S", 0.5)  # the proxy's start reads its state first
    tenant = {**systemd_tenant(), "release": {"kind": "docker", "container": "hang", "socket": str(silent_docker),
                                              "stop_timeout_s": 0}}
    demo = await box(fast("default", tenants={"box": tenant}))
    assert demo.proxy is not None

    r, took = await answered_in(http, proxy_of(demo).url("box") + "/work")
    assert r.status_code == 503 and took < START_TIMEOUT_S + MARGIN_S, (r.status_code, took, r.text)
    error = r.json()["error"]
    assert f"the Docker Engine API at {silent_docker} did not answer POST /containers/hang/start within 1 s" in error, \
        error
