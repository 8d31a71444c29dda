"""`hyperswap serve` on a machine without NVML (no driver, no library, a container without the
device): it says so at start, and every admin answer is true there. Never claim what cannot be
seen: an unknown value is absent or null, not 0 and not "ok"; a release the card did not confirm
is "estimated".

The proxy runs through `cli.serve` (what `hyperswap serve` runs) with the real NVML reader over a
pynvml whose library is missing, the Ollama simulator, and a ComfyUI started with --cpu (a small
fake: the simulator has no CPU mode). The GPU reader is then blind and no engine reports a card,
so the card's size is unknown.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from proxy.admin.health import HealthExtension
from proxy.cli import main, serve
from proxy.config.units import GIB
from proxy.demo import run_prompt
from proxy.engines.loading import registry_from_dict
from proxy.engines.settings import EnvReaders
from proxy.gpu.nvml import NvmlReader
from proxy.gpu.snapshot import GpuReadError
from proxy.relay.servers import RunningServer, start_server
from proxy.service import Proxy
from proxy.sim.box import Scenario, SimBox
from proxy.tasks import poll_until
from tests.integration.boxes import ALL_PORTS_ZERO, DemoFactory, FixedSystemctl, comfyui_of, fast, proxy_of
from tests.unit.fake_pynvml import nvml_without_library

HOST_RAM = int(24.04 * GIB)  # what a --cpu ComfyUI reports as torch_vram_total: host RAM, not VRAM


class CpuComfyUI:
    """ComfyUI started with --cpu, as its API shows it (wire facts B.5): one device of type "cpu",
    index null, whose "vram" figures are host RAM."""

    def __init__(self) -> None:
        self.frees = 0

    def app(self) -> Starlette:
        async def stats(request: Request) -> Response:
            return JSONResponse({
                "system": {"os": "posix", "ram_total": HOST_RAM, "ram_free": 20 * GIB, "comfyui_version": "0.8.0",
                           "python_version": "3.12.3", "pytorch_version": "2.8.0+cpu", "embedded_python": False,
                           "argv": ["main.py", "--cpu"]},
                "devices": [{"name": "cpu", "type": "cpu", "index": None, "vram_total": int(23.54 * GIB),
                             "vram_free": 20 * GIB, "torch_vram_total": HOST_RAM, "torch_vram_free": 20 * GIB}]})

        async def free(request: Request) -> Response:
            self.frees += 1
            return Response(status_code=200)

        async def queue(request: Request) -> Response:
            return JSONResponse({"queue_running": [], "queue_pending": []})

        async def checkpoints(request: Request) -> Response:
            return JSONResponse(["v1-5-pruned-emaonly.safetensors"])

        async def ws(socket: WebSocket) -> None:
            await socket.accept()
            await socket.send_text(json.dumps({"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}},
                                                                          "sid": "cpu"}}))
            await socket.close()

        return Starlette(routes=[Route("/system_stats", stats), Route("/free", free, methods=["POST"]),
                                 Route("/queue", queue), Route("/models/checkpoints", checkpoints),
                                 WebSocketRoute("/ws", ws)])


@dataclass(slots=True)
class Served:
    proxy: Proxy
    box: SimBox
    comfy: CpuComfyUI
    out: io.StringIO
    err: io.StringIO
    systemctl: Any

    @property
    def admin(self) -> str:
        return self.proxy.url("admin")


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Serve]:
    """`hyperswap serve` without NVML in front of the Ollama simulator and a --cpu ComfyUI."""
    stops: list[Callable[[], Awaitable[None]]] = []

    async def make(systemctl: str | None = None) -> Served:
        scenario = Scenario.model_validate({**fast("default").model_dump(), "comfyui": None})
        box = SimBox(scenario)
        await box.start()
        comfy = CpuComfyUI()
        comfy_server: RunningServer = await start_server(comfy.app(), "127.0.0.1", 0)
        overrides = box.tenant_overrides()
        overrides["tenants"]["comfyui"] = {"upstream": comfy_server.url, "release_timeout_s": 1.0}
        proxy = Proxy(registry_from_dict(overrides), NvmlReader(nvml=nvml_without_library()))
        runner = FixedSystemctl(systemctl)
        health = next(e for e in proxy.extensions if isinstance(e, HealthExtension))
        health.env = EnvReaders(systemctl=runner, proc_root=tmp_path)  # host None: decided by the reader
        stop, out, err = asyncio.Event(), io.StringIO(), io.StringIO()
        task = asyncio.create_task(serve(proxy, stop, ALL_PORTS_ZERO, out=out, err=err))

        async def teardown() -> None:
            stop.set()
            await task
            await comfy_server.stop()
            await box.stop()

        stops.append(teardown)
        async with asyncio.timeout(15):
            await poll_until(lambda: err.getvalue() or task.done(), 0.02)
        if task.done():
            task.result()  # raises what went wrong
        return Served(proxy, box, comfy, out, err, runner)

    yield make
    for teardown in reversed(stops):
        await teardown()


async def test_serve_without_nvml_prints_one_line_saying_what_works_and_what_does_not(served: Serve) -> None:
    s = await served()
    lines = s.err.getvalue().splitlines()
    assert len(lines) == 1, f"one clear line on stderr, got {lines}"
    line = lines[0]
    assert line.startswith("hyperswap: no GPU reader (library_missing: "), line
    assert "works: forwarding, in-flight tracking" in line, line
    assert "does not work: arbitration (" in line and "forwarded without a plan" in line, line
    assert "confirmed releases (" in line, line
    assert "fix: install the NVIDIA driver" in line, line
    assert "admin" in s.out.getvalue(), "the addresses still go to stdout"


async def test_health_without_nvml_says_what_works_and_what_does_not(served: Serve, http: httpx.AsyncClient) -> None:
    s = await served()
    body = (await http.get(s.admin + "/api/health")).json()
    caps = {c["name"]: c["status"] for c in body["capabilities"]}
    assert caps == {"forwarding": "ok", "in-flight tracking": "ok", "arbitration": "off", "confirmed releases": "off"}
    nvml = next(e for e in body["entries"] if e["name"] == "nvml")
    assert nvml["status"] == "failed" and nvml["problem"].startswith("library_missing:")
    assert "works: forwarding, in-flight tracking" in nvml["impact"], nvml["impact"]
    assert "does not work: arbitration" in nvml["impact"] and "confirmed releases" in nvml["impact"], nvml["impact"]


async def test_health_of_a_working_reader_says_everything_works(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    body = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    assert {c["name"]: c["status"] for c in body["capabilities"]} == {
        "forwarding": "ok", "in-flight tracking": "ok", "arbitration": "ok", "confirmed releases": "ok"}


async def test_an_unknown_card_is_null_in_stats_and_absent_from_metrics_not_zero(served: Serve,
                                                                                  http: httpx.AsyncClient) -> None:
    s = await served()
    stats = (await http.get(s.admin + "/api/stats")).json()
    device = stats["device"]
    assert device["source"] == "engine-estimate"
    assert {k: device[k] for k in ("total_bytes", "free_bytes", "used_bytes", "reserved_bytes")} == {
        "total_bytes": None, "free_bytes": None, "used_bytes": None, "reserved_bytes": None}, device
    vram = {t["name"]: t["vram_bytes"] for t in stats["tenants"]}
    assert vram == {"ollama": 0, "comfyui": 0, "desktop": None}, "the desktop reports nothing: its VRAM is unknown"

    text = (await http.get(s.admin + "/metrics")).text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    for name in ("hyperswap_gpu_memory_total_bytes", "hyperswap_gpu_memory_free_bytes",
                 "hyperswap_gpu_memory_used_bytes", "hyperswap_unmanaged_vram_bytes"):
        assert not [x for x in samples if x.startswith(name + " ")], f"{name} has a sample for an unknown value"
    assert not [x for x in samples if x.startswith('hyperswap_tenant_vram_bytes{tenant="desktop"}')]
    assert 'hyperswap_tenant_vram_bytes{tenant="ollama"} 0.0' in samples

    health = (await http.get(s.admin + "/api/health")).json()
    unmanaged = next(e for e in health["entries"] if e["name"] == "unmanaged VRAM")
    assert unmanaged["status"] == "unknown", unmanaged
    assert "cannot be checked" in unmanaged["problem"] and "no unmanaged GPU processes" not in unmanaged["problem"]
    assert unmanaged["fix"], "a check that cannot run says how to make it run"
    assert health["status"] == "failed"


async def test_a_card_reported_by_comfyui_keeps_its_size_but_nothing_unmeasured(box: DemoFactory,
                                                                                 http: httpx.AsyncClient) -> None:
    demo = await box("default")
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    admin = proxy_of(demo).url("admin")
    device = (await http.get(admin + "/api/stats")).json()["device"]
    assert device["total_bytes"] == 24 * GIB and device["free_bytes"] is not None, "ComfyUI's cudaMemGetInfo figures"
    assert device["reserved_bytes"] is None, "cudaMemGetInfo has no driver-reserved figure"
    text = (await http.get(admin + "/metrics")).text
    assert "hyperswap_gpu_memory_total_bytes " in text
    assert not [x for x in text.splitlines() if x.startswith("hyperswap_unmanaged_vram_bytes ")]
    caps = {c["name"]: c["status"] for c in (await http.get(admin + "/api/health")).json()["capabilities"]}
    assert caps["arbitration"] == "estimated" and caps["confirmed releases"] == "off"


async def test_plan_without_a_card_size_answers_what_a_request_gets(served: Serve, http: httpx.AsyncClient,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    s = await served()
    dry = (await http.get(s.admin + "/api/plan", params={"tenant": "ollama", "need_gb": 8})).json()["plan"]
    assert dry["outcome"] == "unplanned", dry
    assert dry["explanation"].startswith("forwarded without a plan: the card's size is unknown"), dry["explanation"]
    assert "too large" not in dry["explanation"]
    assert dry["feasible"] is None and dry["possible"] is None and dry["starved"] is None, \
        "unknown is null: without the card's size nothing says the load fits"
    assert dry["free_bytes"] is None and dry["estimated"] is True

    r = await http.post(s.proxy.url("ollama") + "/api/generate",
                        json={"model": "llama3.1:8b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, "and a request is indeed forwarded"

    capsys.readouterr()
    rc = await asyncio.to_thread(main, ["plan", "--tenant", "ollama", "--need-gb", "8", "--admin", s.admin])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("unplanned: forwarded without a plan"), out


async def test_engines_under_serve_without_nvml_say_only_what_was_read(served: Serve, http: httpx.AsyncClient) -> None:
    s = await served(systemctl=None)  # no systemd either (a container)
    view = next(e for e in (await http.get(s.admin + "/api/engines")).json()["engines"] if e["tenant"] == "ollama")
    assert s.systemctl.calls, "the host is the engines' host under serve: systemd is asked"
    assert not any("simulated" in (src.get("error") or "") for src in view["env_sources"]), view["env_sources"]
    environ = next(src for src in view["env_sources"] if src["source"] == "environ")
    assert "GPU reader failed" in environ["error"], environ
    assert {x["source"] for x in view["settings"]} == {"unknown"}, "nothing was read: no setting is a default"


async def test_engines_without_nvml_report_what_the_systemd_unit_says(served: Serve, http: httpx.AsyncClient) -> None:
    s = await served(systemctl="Environment=OLLAMA_KEEP_ALIVE=-1\n")
    view = next(e for e in (await http.get(s.admin + "/api/engines")).json()["engines"] if e["tenant"] == "ollama")
    settings = {x["name"]: x for x in view["settings"]}
    assert (settings["OLLAMA_KEEP_ALIVE"]["value"], settings["OLLAMA_KEEP_ALIVE"]["source"]) == ("-1", "systemd")
    assert settings["OLLAMA_NUM_PARALLEL"]["source"] == "default (not set)", "the unit was read and does not set it"


async def test_a_cpu_comfyui_holds_no_vram_and_its_release_is_a_200_that_says_so(served: Serve,
                                                                                  http: httpx.AsyncClient) -> None:
    s = await served()
    tenant = (await http.get(s.admin + "/api/tenants/comfyui")).json()
    assert tenant["vram_bytes"] == 0, f"host RAM shown as VRAM: {tenant['vram_gb']} GiB"
    device = (await http.get(s.admin + "/api/stats")).json()["device"]
    assert device["total_bytes"] is None and device["name"] != "cpu", "host RAM is not a card"

    r = await http.post(s.admin + "/api/tenants/comfyui/release")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reason"] == "cpu" and "runs on the CPU" in body["note"], body
    assert body["freed_bytes"] == 0 and body["confirmed"] is False and body["estimated"] is False
    assert s.comfy.frees == 0, "nothing is asked of an engine that holds no GPU memory"
    log = (await http.get(s.admin + "/api/decisions")).json()["decisions"]
    assert log[-1]["kind"] == "release" and "runs on the CPU" in log[-1]["outcome"]["result"]


async def test_a_release_not_back_in_time_is_a_504_with_a_fix(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", comfyui={"free_delay_s": 30.0},
                          tenants={"comfyui": {"release_timeout_s": 0.3}}))
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/comfyui/release")
    assert r.status_code == 504, r.text
    body = r.json()
    assert "not back" in body["error"] and "release_timeout_s" in body["fix"], body


async def test_a_release_the_engine_refuses_is_a_502_with_a_fix(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await comfyui_of(demo).stop()
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/comfyui/release")
    assert r.status_code == 502, r.text
    body = r.json()
    assert body["error"] and "hyperswap check" in body["fix"], body


async def test_a_release_judged_on_the_engines_reports_is_estimated_not_confirmed(box: DemoFactory,
                                                                                   http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                        json={"model": "llama3.1:8b", "prompt": "hi", "stream": False})
    assert r.status_code == 200
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    admin = proxy_of(demo).url("admin")
    r = await http.post(admin + "/api/tenants/ollama/release")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["confirmed"] is False and body["estimated"] is True, body
    assert body["error"] is None and body["freed_gb"] > 4
    log = (await http.get(admin + "/api/decisions")).json()["decisions"]
    assert log[-1]["outcome"]["releases"][0]["estimated"] is True and log[-1]["outcome"]["ok"] is False
    metrics = (await http.get(admin + "/metrics")).text
    assert 'hyperswap_releases_total{result="estimated",tenant="ollama"} 1.0' in metrics, \
        [x for x in metrics.splitlines() if x.startswith("hyperswap_releases_total")]

    demo.box.gpu.fail_with = None  # the card is back: a release is confirmed on it again
    await http.post(demo.box.servers["ollama"].url + "/api/generate",
                    json={"model": "llama3.1:8b", "prompt": "hi", "stream": False})
    body = (await http.post(admin + "/api/tenants/ollama/release")).json()
    assert body["confirmed"] is True and body["estimated"] is False, body


async def test_a_reader_that_breaks_later_keeps_the_cards_measured_size(box: DemoFactory) -> None:
    """After a driver update the reader fails until the reboot: the card did not shrink, so plans go
    on with its last measured total through every failed read, not just the first."""
    data = fast("default").model_dump()
    data.update(comfyui=None, tenants={"comfyui": None})  # no engine left that reports the card
    demo = await box(Scenario.model_validate(data))
    broker = proxy_of(demo).broker
    measured = (await broker.snapshot()).snapshot.device.total_bytes

    class Broken:
        def read(self) -> Any:
            raise GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")

    broker.reader = Broken()
    for _ in range(3):
        snap = await broker.snapshot()
        assert snap.estimated and snap.snapshot.device.total_bytes == measured
