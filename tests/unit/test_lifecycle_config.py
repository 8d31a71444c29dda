"""tenants.json's lifecycle kinds (process, systemd, docker), http's resume and release steps: the
shapes of issue 23 load, bad ones are named by their path, a missing program is refused at load."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import main
from proxy.config.loading import SHIPPED_DEFAULTS
from proxy.config.registry import Registry
from proxy.engines import adapter_for
from proxy.engines.common import ReleaseFailed, release_by_strategy, resume_by_strategy
from proxy.engines.loading import load_registry, registry_from_dict
from proxy.errors import ConfigError
from proxy.lifecycle import probe_for
from proxy.lifecycle.docker import DockerRelease
from proxy.lifecycle.process import ProcessRelease
from proxy.lifecycle.systemd import SystemdRelease

UP = "http://127.0.0.1:8081"


def load(tenants: dict[str, Any]) -> Registry:
    return registry_from_dict({"tenants": tenants})


def problems(tenants: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load(tenants)
    return err.value.problems


def test_the_issues_three_shapes_load_as_a_user_would_guess_them() -> None:
    reg = load({
        "llama": {"upstream": UP, "release": {"kind": "process", "command": ["sh", "-c", "exec llama-server"]}},
        "comfy": {"upstream": "http://127.0.0.1:8188", "release": {"kind": "systemd", "unit": "comfyui.service"}},
        "tts": {"upstream": "http://127.0.0.1:5002", "release": {"kind": "docker", "container": "tts"}},
    })
    llama, comfy, tts = reg.get("llama"), reg.get("comfy"), reg.get("tts")
    assert isinstance(llama.lifecycle, ProcessRelease) and llama.lifecycle.command == ["sh", "-c", "exec llama-server"]
    assert llama.lifecycle.effective_stop_timeout_s == 10.0 and llama.start_timeout_s == 120.0
    assert isinstance(comfy.lifecycle, SystemdRelease) and comfy.lifecycle.effective_scope == "system"
    assert isinstance(tts.lifecycle, DockerRelease) and tts.lifecycle.effective_socket == "/var/run/docker.sock"
    assert all(t.reclaimable for t in (llama, comfy, tts))


def test_existing_configs_load_unchanged() -> None:
    shipped = json.loads(SHIPPED_DEFAULTS.read_text())
    reg = registry_from_dict(shipped)
    assert [t.lifecycle for t in reg] == [None, None, None], "no shipped tenant is stopped and started"
    assert reg.get("ollama").release_steps[0].kind == "ollama_unload"
    assert reg.get("desktop").not_reclaimable_reason.startswith("the desktop's display server")
    dumped = reg.get("comfyui").model_dump(mode="json")["release"]
    assert dumped == {"kind": "comfyui_free", "timeout_s": None, "unload_models": True, "free_memory": True}, \
        "a step holds its own kind's fields only"
    again = registry_from_dict({"tenants": {"comfyui": {"release": dumped}}})
    assert again.get("comfyui").release == reg.get("comfyui").release, "a dumped release loads back the same"


def test_release_steps_escalate_and_each_has_its_own_timeout() -> None:
    reg = load({"comfyui": {"release": [
        {"kind": "comfyui_free", "timeout_s": 15},
        {"kind": "systemd", "unit": "comfyui.service", "scope": "user", "timeout_s": 60}]}})
    comfy = reg.get("comfyui")
    assert [s.kind for s in comfy.release_steps] == ["comfyui_free", "systemd"]
    assert [s.timeout_s for s in comfy.release_steps] == [15.0, 60.0]
    assert comfy.lifecycle is comfy.release_steps[1]
    assert comfy.release_path(1) == "tenants.comfyui.release.1"


@pytest.mark.parametrize(("tenant", "expected"), [
    ({"upstream": UP, "release": {"kind": "process"}}, "tenants.x.release.command: release kind 'process' needs 'command'"),
    ({"upstream": UP, "release": {"kind": "process", "command": []}}, "tenants.x.release.command: expected the program"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["bin/llama-server"]}},
     "tenants.x.release.command: 'bin/llama-server': give the program as an absolute path"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["sh"], "cwd": "models"}},
     "tenants.x.release.cwd: expected an absolute path"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["sh"], "env": {"1X": "a"}}},
     "tenants.x.release.env: '1X' is not an environment variable name"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["sh"], "unit": "a.service"}},
     "tenants.x.release.unit: only release kind 'systemd' takes 'unit'"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["sh"], "stop_timeout_s": -1}},
     "tenants.x.release.stop_timeout_s: must be >= 0"),
    ({"upstream": UP, "release": {"kind": "systemd"}}, "tenants.x.release.unit: release kind 'systemd' needs 'unit'"),
    ({"upstream": UP, "release": {"kind": "systemd", "unit": "--now"}}, "tenants.x.release.unit: '--now' is not a systemd unit"),
    ({"upstream": UP, "release": {"kind": "systemd", "unit": "a.service", "scope": "session"}},
     "tenants.x.release.scope: expected 'system' or 'user'"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "../images"}},
     "tenants.x.release.container: '../images' is not a container name"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "tts", "socket": "docker.sock"}},
     "tenants.x.release.socket: expected an absolute path"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "tts", "cwd": "/srv"}},
     "tenants.x.release.cwd: only release kind 'process' takes 'cwd'"),
    ({"release": {"kind": "docker", "container": "tts"}},
     "tenants.x.release: a tenant the proxy stops and starts needs an 'upstream'"),
    ({"upstream": UP, "release": {"kind": "http", "url": "/sleep", "resume": {"url": "wake_up"}}},
     "tenants.x.release.resume.url: expected a path on the upstream"),
    ({"upstream": UP, "release": {"kind": "comfyui_free", "resume": {"url": "/x"}}},
     "tenants.x.release.resume: only release kind 'http' takes 'resume'"),
    ({"release": 3}, "tenants.x.release: expected an object (one release) or a list of them"),
    ({"release": []}, "tenants.x.release: an empty list releases nothing"),
    ({"release": [{"kind": "comfyui_free"}, {"kind": "systemd"}]},
     "tenants.x.release.1.unit: release kind 'systemd' needs 'unit'"),
    ({"release": [{"kind": "comfyui_free"}, {"kind": "procss"}]}, "tenants.x.release.1.kind: expected 'ollama_unload'"),
    ({"upstream": UP, "release": [{"kind": "systemd", "unit": "a.service"}, {"kind": "comfyui_free"}]},
     "tenants.x.release: step 0 stops the app, so the steps after it have nothing left"),
    ({"upstream": UP, "release": [{"kind": "systemd", "unit": "a.service"}, {"kind": "docker", "container": "c"}]},
     "tenants.x.release: steps [0, 1] each stop the app"),
    ({"release": [{"kind": "none"}]}, "tenants.x.release: a step of kind 'none' releases nothing"),
    ({"release": [{"kind": "comfyui_free", "timeout_s": 0}]}, "tenants.x.release.0.timeout_s: must be > 0"),
    ({"upstream": UP, "ready": {"path": "/health"}}, "tenants.x.ready: 'ready' applies to a tenant the proxy starts"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "c"}, "ready": {"path": "health"}},
     "tenants.x.ready.path: expected a path on the upstream starting with '/'"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "c"}, "ready": {"path": "/h", "tcp": True}},
     "tenants.x.ready: give either a path or tcp: true"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "c"}, "start_timeout_s": 0},
     "tenants.x.start_timeout_s: must be > 0"),
    ({"upstream": UP, "release": {"kind": "docker", "container": "c", "stop_command": ["docker", "stop", "c"]}},
     "tenants.x.release.stop_command: only release kind 'process' takes 'stop_command'"),
    ({"upstream": UP, "release": {"kind": "process", "command": ["sh"], "stop_command": []}},
     "tenants.x.release.stop_command: expected the program and its arguments"),
    ({"upstream": UP, "preload": True}, "tenants.x.preload: 'preload' applies to a tenant the proxy starts"),
])
def test_a_bad_lifecycle_field_is_named_by_its_path(tenant: dict[str, Any], expected: str) -> None:
    found = problems({"x": tenant})
    assert any(p.startswith(expected) for p in found), f"expected a problem starting {expected!r}, got {found}"


def test_a_missing_program_is_refused_at_load_naming_its_path(tmp_path: Path) -> None:
    not_exec = tmp_path / "server.sh"
    not_exec.write_text("#!/bin/sh\n")
    found = problems({
        "a": {"upstream": "http://127.0.0.1:1", "release": {"kind": "process", "command": ["no-such-server-x9"]}},
        "b": {"upstream": "http://127.0.0.1:2", "release": [{"kind": "http", "url": "/unload"},
                                                            {"kind": "process", "command": [str(not_exec)]}]},
        "c": {"upstream": "http://127.0.0.1:3", "release": {"kind": "process", "command": ["/nonexistent/server"],
                                                            "cwd": str(tmp_path / "gone")}},
    })
    assert any(p.startswith("tenants.a.release.command.0: 'no-such-server-x9' is not found on PATH") for p in found), found
    assert f"tenants.b.release.1.command.0: {not_exec} is not executable" in found[1], found
    assert "tenants.c.release.command.0: /nonexistent/server does not exist (or is not a file)" in found
    assert f"tenants.c.release.cwd: {tmp_path / 'gone'} is not a directory" in found


def test_a_missing_stop_command_program_is_refused_at_load_naming_its_path() -> None:
    found = problems({"a": {"upstream": "http://127.0.0.1:1", "preload": True, "release": {
        "kind": "process", "command": [sys.executable], "stop_command": ["no-such-stopper-x9", "tts"]}}})
    assert any(p.startswith("tenants.a.release.stop_command.0: 'no-such-stopper-x9' is not found on PATH")
               for p in found), found


def test_a_program_is_looked_up_on_the_path_the_child_gets(tmp_path: Path) -> None:
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    tenant: dict[str, Any] = {"upstream": UP, "release": {"kind": "process", "command": ["llama-server"]}}
    with pytest.raises(ConfigError):
        load({"llama": tenant})
    tenant["release"]["env"] = {"PATH": str(tmp_path)}
    assert load({"llama": tenant}).get("llama").lifecycle is not None


def test_the_cli_exits_2_naming_a_missing_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "t.json"
    cfg.write_text(json.dumps({"tenants": {"llama": {"upstream": UP, "release": {
        "kind": "process", "command": ["no-such-server-x9", "--port", "8081"]}}}}))
    assert main(["tenants", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "tenants.llama.release.command.0: 'no-such-server-x9' is not found on PATH" in err
    assert "Traceback" not in err


def test_the_loader_looks_programs_up_on_its_own_environments_path(tmp_path: Path) -> None:
    cfg = tmp_path / "t.json"
    cfg.write_text(json.dumps({"tenants": {"llama": {"upstream": UP, "release": {"kind": "process",
                                                                                   "command": ["llama-server"]}}}}))
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(0o755)
    assert load_registry(cfg, env={"PATH": str(tmp_path)}).get("llama").lifecycle is not None
    with pytest.raises(ConfigError):
        load_registry(cfg, env={"PATH": str(tmp_path / "empty")})


def test_the_ready_probe_defaults_by_engine_kind_and_tenants_json_overrides_it() -> None:
    started = {"release": {"kind": "docker", "container": "c"}}
    reg = load({
        "ollama": {**started},
        "comfyui": {**started},
        "app": {"upstream": "http://127.0.0.1:9000", **started},
        "vllm": {"upstream": "http://127.0.0.1:8000", **started, "ready": {"path": "/health", "status": 204}},
        "tcp": {"engine": "ollama", "upstream": "http://127.0.0.1:9001", **started, "ready": {"tcp": True}},
    })
    probes = {t.name: probe_for(t, adapter_for(t).ready_path) for t in reg if t.lifecycle}
    assert probes["ollama"].url == "http://127.0.0.1:11434/api/version"
    assert probes["comfyui"].url == "http://127.0.0.1:8188/system_stats"
    assert probes["app"].url is None and (probes["app"].host, probes["app"].port) == ("127.0.0.1", 9000)
    assert (probes["vllm"].url, probes["vllm"].status) == ("http://127.0.0.1:8000/health", 204)
    assert probes["tcp"].url is None, "tcp: true wins over the engine's path"


async def test_an_http_release_step_and_its_resume_call_the_upstream() -> None:
    calls: list[tuple[str, str, bytes]] = []

    def app(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, str(request.url), request.content))
        return httpx.Response(200)

    reg = load({"vllm": {"upstream": "http://127.0.0.1:8000", "release": {
        "kind": "http", "url": "/sleep?level=1", "resume": {"url": "/wake_up", "body": {"tags": ["weights"]}}}}})
    vllm = reg.get("vllm")
    async with httpx.AsyncClient(transport=httpx.MockTransport(app)) as client:
        assert await release_by_strategy(vllm, client) == {"call": "POST http://127.0.0.1:8000/sleep?level=1", "status": 200}
        assert await adapter_for(vllm).resume(client, vllm.release_steps[0]) == {
            "call": "POST http://127.0.0.1:8000/wake_up", "status": 200}
    assert calls[1] == ("POST", "http://127.0.0.1:8000/wake_up", b'{"tags":["weights"]}')


async def test_a_refused_resume_and_a_lifecycle_step_fail_with_what_happened() -> None:
    reg = load({"vllm": {"upstream": "http://127.0.0.1:8000", "release": [
        {"kind": "http", "url": "/sleep", "resume": {"url": "/wake_up"}},
        {"kind": "docker", "container": "vllm"}]}})
    vllm = reg.get("vllm")
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))) as client:
        with pytest.raises(ReleaseFailed, match=r"resume call POST http://127.0.0.1:8000/wake_up answered 500"):
            await resume_by_strategy(vllm, client, vllm.release_steps[0])
        assert await resume_by_strategy(vllm, client, vllm.release_steps[1]) is None, "a stopped app is started, not resumed"
        with pytest.raises(ReleaseFailed, match="released by stopping it"):
            await release_by_strategy(vllm, client, vllm.release_steps[1])


def test_the_process_check_uses_the_test_interpreter() -> None:
    # the real-child tests run `sys.executable`: an absolute path the loader must accept
    reg = load({"p": {"upstream": UP, "release": {"kind": "process", "command": [sys.executable, "-V"]}}})
    step = reg.get("p").lifecycle
    assert isinstance(step, ProcessRelease) and step.command and os.access(step.command[0], os.X_OK)
