"""/api/health, /api/engines and `hyperswap check` against the simulated box: every check driven
into its failure state."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from proxy.admin.health import HealthEntry, HealthExtension, NamedCheck, check_main
from proxy.demo import Demo
from proxy.engines.settings import EnvReaders
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import GpuReadError
from proxy.relay.servers import start_server
from tests.integration.boxes import DemoFactory, FixedSystemctl, comfyui_of, fast, ollama_of, proxy_of

KEYS = {"name", "status", "problem", "impact", "fix"}


def health_ext(demo: Any) -> HealthExtension:
    return next(e for e in proxy_of(demo).extensions if isinstance(e, HealthExtension))


async def health(http: httpx.AsyncClient, demo: Demo) -> dict[str, Any]:
    r = await http.get(proxy_of(demo).url("admin") + "/api/health")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert all(set(e) == KEYS for e in body["entries"]), body["entries"]
    return body


def entry(body: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [e for e in body["entries"] if e["name"] == name]
    assert found, f"no entry {name!r} in {[e['name'] for e in body['entries']]}"
    return found[0]


async def test_healthy_default_box_is_ok_with_versions_and_simulated_gpu(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    body = await health(http, demo)
    # Telemetry has its own tests below: whether its store is wired in is not this test's business.
    assert [e for e in body["entries"] if e["status"] != "ok" and e["name"] != "telemetry"] == []
    assert "simulated GPU" in entry(body, "nvml")["problem"]
    assert "0.12.3" in entry(body, "upstream ollama")["problem"]
    assert "0.8.0" in entry(body, "upstream comfyui")["problem"]
    assert entry(body, "upstream desktop")["problem"] == "no upstream (VRAM-only tenant)"
    assert "sid" in entry(body, "comfyui websocket comfyui")["problem"]


async def test_stopped_ollama_fails_its_upstream_entry_with_a_fix(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await ollama_of(demo).stop()
    body = await health(http, demo)
    e = entry(body, "upstream ollama")
    assert e["status"] == "failed" and body["status"] == "failed"
    assert "cannot reach" in e["problem"]
    assert "ollama serve" in e["fix"] and "upstream" in e["fix"], e["fix"]
    assert "502" in e["impact"]


async def test_stopped_comfyui_fails_http_and_websocket_entries(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await comfyui_of(demo).stop()
    body = await health(http, demo)
    assert entry(body, "upstream comfyui")["status"] == "failed"
    ws = entry(body, "comfyui websocket comfyui")
    assert ws["status"] == "failed" and ws["fix"] and "progress" in ws["impact"]


async def test_failing_gpu_reader_fails_nvml_with_the_readers_fix(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch",
                                          "reboot after the driver update")
    body = await health(http, demo)
    e = entry(body, "nvml")
    assert e["status"] == "failed" and body["status"] == "failed"
    assert e["problem"] == "driver_mismatch: Driver/library version mismatch"
    assert e["fix"] == "reboot after the driver update"
    assert entry(body, "upstream ollama")["status"] == "ok", "a broken GPU reader must not break the other checks"


async def test_stale_queue_row_is_degraded_and_names_the_prompt_id(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", comfyui={"stale_running_entry": True}))
    await proxy_of(demo).watchdog.tick()
    stale_id = comfyui_of(demo).stale_prompt_id
    assert stale_id
    body = await health(http, demo)
    e = entry(body, "stale queue entries comfyui")
    assert e["status"] == "degraded" and body["status"] == "degraded"
    assert stale_id in e["problem"]
    assert 'POST /queue {"clear":true} or restart ComfyUI' in e["fix"]


async def test_tight_box_states_the_unmanaged_relays_cost_naming_pid_4242(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("tight")
    body = await health(http, demo)
    e = entry(body, "unmanaged VRAM (ollama)")
    assert e["status"] == "degraded"
    # 16 GiB - 0.4 reserved - 0.1 Xorg - 0.4 ComfyUI floor = 15.10; minus the relay's 0.84 = 14.26.
    assert e["problem"] == ("1 model(s) fit within 15.10 GiB but not the 14.26 GiB actually available: "
                            "held by python stt_relay.py (pid 4242, 0.84 GiB)")
    assert "mistral-small:22b" in e["impact"] and "qwen2.5:14b" not in e["impact"]
    assert "4242" in e["fix"]


async def test_comfyui_floor_is_the_minimum_of_recent_samples(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("tight")
    ext = health_ext(demo)
    await health(http, demo)  # samples ComfyUI at its context floor (0.4 GiB)
    demo.box.gpu.set_used(comfyui_of(demo).pid or 0, int(3.4 * 2**30))  # now holding a checkpoint
    e = entry(await health(http, demo), "unmanaged VRAM (ollama)")
    assert "15.10 GiB" in e["problem"], "the floor must stay the minimum sample, not what ComfyUI holds now"
    assert ext.floor("comfyui") == int(0.4 * 2**30)


async def test_a_model_too_large_for_the_card_is_not_blamed_on_the_relay(box: DemoFactory, http: httpx.AsyncClient) -> None:
    sc = fast("tight", tenants={"ollama": {"model_vram_gb": {"mistral-small:22b": 15.5}}})
    demo = await box(sc)
    e = entry(await health(http, demo), "unmanaged VRAM (ollama)")
    assert e["status"] == "ok" and "mistral" not in (e["impact"] or ""), e
    assert "4242" in e["problem"], "the relay's VRAM is still reported"


async def test_a_check_that_raises_is_failed_and_the_endpoint_still_answers(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")

    async def broken(snap: AttributedSnapshot) -> HealthEntry:
        raise RuntimeError("disk on fire")

    health_ext(demo).checks.append(NamedCheck("broken check", broken))
    body = await health(http, demo)
    e = entry(body, "broken check")
    assert e["status"] == "failed" and "RuntimeError: disk on fire" in e["problem"]
    assert entry(body, "nvml")["status"] == "ok"
    assert body["status"] == "failed"


async def test_a_check_that_hangs_times_out_as_failed(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    ext = health_ext(demo)
    never = asyncio.Event()

    async def hangs(snap: AttributedSnapshot) -> HealthEntry:
        await never.wait()
        return HealthEntry("hangs", "ok")

    ext.timeout_s = 0.2
    ext.checks.append(NamedCheck("hangs", hangs))
    e = entry(await health(http, demo), "hangs")
    assert e["status"] == "failed" and "did not finish" in e["problem"]


async def test_invalid_config_file_fails_the_configuration_entry(box: DemoFactory, http: httpx.AsyncClient,
                                                                 tmp_path: Path) -> None:
    demo = await box("default")
    bad = tmp_path / "tenants.json"
    bad.write_text('{"tenants": {"ollama": {"priority": "high"}}}')
    proxy_of(demo).config_path = bad
    e = entry(await health(http, demo), "configuration")
    assert e["status"] == "failed"
    assert str(bad) in e["problem"] and "tenants.ollama.priority" in e["problem"], e["problem"]
    good = tmp_path / "ok.json"
    good.write_text('{"tenants": {}}')
    proxy_of(demo).config_path = good
    assert entry(await health(http, demo), "configuration") == {
        "name": "configuration", "status": "ok", "problem": f"{good}: valid", "impact": None, "fix": None}


class FakeTelemetry:
    def __init__(self, ok: bool, text: str) -> None:
        self.result = (ok, text)

    def healthy(self) -> tuple[bool, str]:
        return self.result


@pytest.mark.parametrize("store, status, words", [
    (None, "degraded", "not configured"),
    (FakeTelemetry(False, "telemetry writes failing: disk I/O error (3 rows dropped)"), "degraded", "disk I/O error"),
    (FakeTelemetry(True, "telemetry writing to /x.sqlite3 (12 rows)"), "ok", "12 rows"),
])
async def test_telemetry_entry_follows_the_stores_own_health(box: DemoFactory, http: httpx.AsyncClient,
                                                             monkeypatch: pytest.MonkeyPatch, store: Any, status: str,
                                                             words: str) -> None:
    demo = await box("default")
    monkeypatch.setattr(health_ext(demo), "telemetry", lambda: store)
    e = entry(await health(http, demo), "telemetry")
    assert e["status"] == status and words in e["problem"], e
    if status != "ok":
        assert e["impact"] and e["fix"]


# -- /api/engines --------------------------------------------------------------------------------------


def settings_of(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in view["settings"]}


async def test_engines_reads_ollama_env_from_systemd_then_from_the_processes_environ(
        box: DemoFactory, http: httpx.AsyncClient, tmp_path: Path) -> None:
    demo = await box("default")
    systemctl = FixedSystemctl("Environment=OLLAMA_NUM_PARALLEL=1 OLLAMA_MAX_LOADED_MODELS=1\n")
    health_ext(demo).env = EnvReaders(systemctl=systemctl, proc_root=tmp_path, host=True)
    admin = proxy_of(demo).url("admin")

    view = (await http.get(admin + "/api/engines")).json()["engines"][0]
    assert view["tenant"] == "ollama" and view["version"] == "0.12.3"
    s = settings_of(view)
    assert (s["OLLAMA_NUM_PARALLEL"]["source"], s["OLLAMA_NUM_PARALLEL"]["status"]) == ("systemd", "deferred")
    assert "every swap" in s["OLLAMA_MAX_LOADED_MODELS"]["meaning"]
    assert s["OLLAMA_KEEP_ALIVE"]["source"] == "default (not set)"
    environ = next(x for x in view["env_sources"] if x["source"] == "environ")
    assert environ["ok"] is False and "no ollama process" in environ["error"]
    assert systemctl.calls == [["systemctl", "show", "ollama.service", "--property=Environment"]]

    # A loaded model gives attribution a process; its (fake) /proc environ is what the process really has.
    r = await http.post(demo.box.servers["ollama"].url + "/api/generate", json={"model": "llama3.1:8b", "prompt": "hi",
                                                                                "stream": False})
    assert r.status_code == 200
    snap = await proxy_of(demo).broker.snapshot()
    pid = snap.processes_of("ollama")[0].process.pid
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "environ").write_bytes(b"OLLAMA_KEEP_ALIVE=-1\0OLLAMA_NUM_PARALLEL=4\0")
    s = settings_of((await http.get(admin + "/api/engines")).json()["engines"][0])
    assert (s["OLLAMA_KEEP_ALIVE"]["value"], s["OLLAMA_KEEP_ALIVE"]["source"]) == ("-1", "environ")
    assert (s["OLLAMA_NUM_PARALLEL"]["value"], s["OLLAMA_NUM_PARALLEL"]["status"]) == ("4", "note")


async def test_engines_never_reads_the_host_for_a_simulated_gpu(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    systemctl = FixedSystemctl("Environment=OLLAMA_NUM_PARALLEL=8\n")
    health_ext(demo).env = EnvReaders(systemctl=systemctl)  # host=None: auto
    view = (await http.get(proxy_of(demo).url("admin") + "/api/engines")).json()["engines"][0]
    assert systemctl.calls == []
    assert all(s["source"] == "unknown" for s in view["settings"]), "nothing was read: no setting is a default"
    assert "simulated" in view["env_sources"][0]["error"]


async def test_engines_describes_comfyui_from_system_stats(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", comfyui={"argv": ["main.py", "--highvram", "--reserve-vram", "1.5"]}))
    engines = (await http.get(proxy_of(demo).url("admin") + "/api/engines")).json()["engines"]
    comfy = next(e for e in engines if e["engine"] == "comfyui")
    assert comfy["version"] == "0.8.0" and comfy["pytorch_version"] == "2.9.1+cu128"
    assert "Simulated" in comfy["device_name"]
    flags = {f["flag"]: f for f in comfy["flags"]}
    assert flags["--highvram"]["status"] == "warn" and "/free" in flags["--highvram"]["meaning"]
    assert flags["--reserve-vram"]["value"] == "1.5"


async def test_trimmed_system_stats_does_not_make_comfyui_look_offline(box: DemoFactory, http: httpx.AsyncClient) -> None:
    async def stats(request: Any) -> JSONResponse:
        return JSONResponse({"system": {"comfyui_version": "v0.2.2-30-gabc"}})  # no python_version, argv, devices

    async def ws(socket_: WebSocket) -> None:
        await socket_.accept()
        await socket_.send_text(json.dumps({"type": "status", "data": {"status": {}, "sid": "x"}}))
        await socket_.close()

    old = await start_server(Starlette(routes=[Route("/system_stats", stats), WebSocketRoute("/ws", ws)]), "127.0.0.1", 0)
    try:
        demo = await box(fast("default", tenants={"comfy-old": {"engine": "comfyui", "upstream": old.url,
                                                                "release": {"kind": "comfyui_free"}}}))
        body = await health(http, demo)
        assert entry(body, "upstream comfy-old")["status"] == "ok"
        assert "v0.2.2-30-gabc" in entry(body, "upstream comfy-old")["problem"]
        assert entry(body, "comfyui websocket comfy-old")["status"] == "ok"
        engines = (await http.get(proxy_of(demo).url("admin") + "/api/engines")).json()["engines"]
        view = next(e for e in engines if e["tenant"] == "comfy-old")
        assert view["reachable"] is True and view["error"] is None
        assert view["version"] == "v0.2.2-30-gabc" and view["python_version"] is None and view["flags"] == []
    finally:
        await old.stop()


# -- hyperswap check ---------------------------------------------------------------------------------

async def test_check_prints_the_entries_and_exits_1_on_a_failure(box: DemoFactory, capsys: pytest.CaptureFixture[str]) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    assert await asyncio.to_thread(check_main, None, admin, False) == 0
    out = capsys.readouterr().out
    assert "upstream ollama" in out and out.rstrip().endswith("overall: ok")

    await ollama_of(demo).stop()
    assert await asyncio.to_thread(check_main, None, admin, True) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["status"] == "failed"


def test_check_without_a_running_proxy_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    assert check_main(None, f"127.0.0.1:{port}", False) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no HyperSwap proxy answers at")
    assert "Traceback" not in captured.err


def test_check_finds_the_admin_listener_in_the_config_and_reports_a_bad_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps({"admin": {"listen": f"127.0.0.1:{port}"}}))
    assert check_main(str(cfg), None, False) == 2
    assert f"127.0.0.1:{port}" in capsys.readouterr().err

    cfg.write_text("{not json")
    assert check_main(str(cfg), None, False) == 2
    err = capsys.readouterr().err
    assert "invalid JSON" in err and "Traceback" not in err
