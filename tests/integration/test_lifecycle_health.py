"""Health of tenants the proxy starts and stops, on the simulated box: a failed start with its error
and fix, an orphan of an earlier run named (and left running), an unreachable Docker socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx

from proxy.config.settings import AdminSpec
from proxy.lifecycle.build import default_state_dir
from proxy.lifecycle.process import _start_time
from proxy.lifecycle.record import instance_dir
from tests.integration.boxes import DemoFactory, fast, free_port, process_tenant, proxy_of


async def test_health_names_failed_starts_orphans_and_an_unreachable_docker_socket(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    app = process_tenant(free_port(), tmp_path)
    command = app["release"]["command"]
    orphan = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(120)",
                                                  start_new_session=True)
    try:
        # what an earlier proxy that crashed left behind: its pidfile, and its child still running
        state = instance_dir(default_state_dir(), AdminSpec().listen)  # the demo's instance (its admin address)
        state.mkdir(parents=True, exist_ok=True)
        (state / "app.process.json").write_text(json.dumps({"pid": orphan.pid, "start_time": _start_time(orphan.pid),
                                                            "command": command}))
        bad = process_tenant(free_port(), tmp_path, release={"kind": "process", "command": [sys.executable, "-c", "exit(3)"]})
        dock = {**process_tenant(free_port(), tmp_path),
                "release": {"kind": "docker", "container": "tts", "socket": str(tmp_path / "docker.sock")}}
        demo = await box(fast("default", tenants={"app": app, "bad": bad, "dock": dock}))
        assert demo.proxy is not None
        admin = proxy_of(demo).url("admin")
        assert (await http.post(admin + "/api/tenants/bad/start")).status_code == 503
        report = (await http.get(admin + "/api/health")).json()
        entries = {e["name"]: e for e in report["entries"] if e["name"].startswith("lifecycle")}

        named = entries["lifecycle app"]
        assert named["status"] == "failed" and f"process {orphan.pid} from an earlier run" in named["problem"], named
        assert f"kill {orphan.pid}" in named["fix"] and "(fix:" not in named["problem"], named
        assert orphan.returncode is None, "an orphan is named, never killed"

        failed = entries["lifecycle bad"]
        assert failed["status"] == "failed" and "last start failed" in failed["problem"] and failed["fix"], failed
        assert "503" in failed["impact"]

        socket = entries["lifecycle dock"]
        assert socket["status"] == "failed" and "cannot reach the Docker Engine API" in socket["problem"], socket
        assert "no socket at" in socket["fix"], socket
        assert report["status"] == "failed"
    finally:
        os.killpg(orphan.pid, signal.SIGKILL)
        await orphan.wait()


async def test_a_lifecycle_tenant_that_is_well_is_an_ok_entry(box: DemoFactory, http: httpx.AsyncClient,
                                                               tmp_path: Path) -> None:
    demo = await box(fast("default", tenants={"app": process_tenant(free_port(), tmp_path)}))
    assert demo.proxy is not None
    report = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    (entry,) = [e for e in report["entries"] if e["name"] == "lifecycle app"]
    assert entry["status"] == "ok" and entry["problem"].startswith("stopped for") and "http.server" in entry["problem"]
    (upstream,) = [e for e in report["entries"] if e["name"] == "upstream app"]
    assert upstream["status"] == "ok" and upstream["problem"].startswith("stopped"), \
        f"a tenant stopped on purpose is no unreachable upstream: {upstream}"
    assert report["status"] == "ok", [e for e in report["entries"] if e["status"] != "ok"]
