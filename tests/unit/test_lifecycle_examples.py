"""examples/lifecycle: each tenants.json loads with the real loader, and says what its comment says."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines import adapter_for
from proxy.engines.http_release import HttpRelease
from proxy.engines.loading import load_registry
from proxy.lifecycle import probe_for
from proxy.lifecycle.docker import DockerRelease
from proxy.lifecycle.process import ProcessRelease
from proxy.lifecycle.systemd import SystemdRelease

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "lifecycle"


@pytest.fixture
def path_with_llama_server(tmp_path: Path) -> dict[str, str]:
    """A PATH holding a `llama-server` (the loader refuses a program it cannot find)."""
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    return {"PATH": str(tmp_path)}


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == [
        "comfyui-systemd.json", "llama-server.json", "sd-webui.json", "tts-docker.json", "vllm.json"]


def test_llama_server_is_a_process_the_proxy_runs(path_with_llama_server: dict[str, str]) -> None:
    reg = load_registry(EXAMPLES / "llama-server.json", env=path_with_llama_server)
    llama = reg.get("llama")
    assert isinstance(llama.lifecycle, ProcessRelease) and llama.lifecycle.kind == "process"
    assert llama.lifecycle.command is not None and "8081" in llama.lifecycle.command
    assert probe_for(llama, adapter_for(llama).ready_path).url == "http://127.0.0.1:8081/health"
    assert "llama-server" not in reg.get("ollama").match.process_names, "its processes are not attributed to Ollama"


def test_vllm_sleeps_and_wakes_up() -> None:
    step = load_registry(EXAMPLES / "vllm.json", env={}).get("vllm").release_steps[0]
    assert isinstance(step, HttpRelease), step
    assert (step.kind, step.url, step.timeout_s) == ("http", "/sleep?level=1", 30.0)
    assert step.resume is not None and step.resume.url == "/wake_up"


def test_the_webui_unloads_and_reloads_its_checkpoint() -> None:
    step = load_registry(EXAMPLES / "sd-webui.json", env={}).get("sdwebui").release_steps[0]
    assert isinstance(step, HttpRelease), step
    assert step.url == "/sdapi/v1/unload-checkpoint"
    assert step.resume is not None and step.resume.url == "/sdapi/v1/reload-checkpoint"


def test_comfyui_under_systemd_frees_then_restarts() -> None:
    comfy = load_registry(EXAMPLES / "comfyui-systemd.json", env={}).get("comfyui")
    assert [s.kind for s in comfy.release_steps] == ["comfyui_free", "systemd"]
    assert isinstance(comfy.lifecycle, SystemdRelease) and comfy.lifecycle.unit == "comfyui.service"
    assert comfy.upstream == "http://127.0.0.1:8188", "the shipped upstream stays"
    assert probe_for(comfy, adapter_for(comfy).ready_path).url == "http://127.0.0.1:8188/system_stats"


def test_the_tts_server_is_a_docker_container() -> None:
    tts = load_registry(EXAMPLES / "tts-docker.json", env={}).get("tts")
    assert isinstance(tts.lifecycle, DockerRelease) and (tts.lifecycle.kind, tts.lifecycle.container) == ("docker", "tts")
    # Docker publishes a port before the app inside listens, so a TCP probe would pass too early.
    assert probe_for(tts, adapter_for(tts).ready_path).url == "http://127.0.0.1:8021/health"
