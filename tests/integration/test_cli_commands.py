"""Each command run as a user runs it (the command line, its --help, its exit status, what it prints),
pinning what the first hour with HyperSwap tripped over (issue 26)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

import proxy.demo
from proxy.cli import main
from proxy.demo import describe, run_prompt
from proxy.deploy import install
from proxy.sim.box import fast_scenario, scenario_names
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, ollama_of, proxy_of

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = (ROOT / "docs" / "reference" / "cli.md").read_text()


def hyperswap(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command line, in a process of its own (python -m proxy.cli is what the entry point runs)."""
    env = {**os.environ, "COLUMNS": "200"}  # argparse wraps --help to the terminal, splitting "two-gpus" at its hyphen
    return subprocess.run([sys.executable, "-m", "proxy.cli", *argv], capture_output=True, text=True, timeout=60,
                          cwd=cwd or ROOT, env=env)


# -- hyperswap demo ---------------------------------------------------------------------------------

def test_demo_help_lists_every_shipped_scenario() -> None:
    out = hyperswap("demo", "--help").stdout
    listed = " ".join(out.split())  # argparse wraps the help text
    missing = [name for name in scenario_names() if name not in listed]
    assert not missing, f"demo --help leaves out {missing}:\n{out}"
    assert "gpu-drift" in listed


def test_demo_config_is_handed_to_the_demo_not_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def fake_demo_main(scenario: str, check: bool, with_proxy: bool = True, fast: bool = False,
                             config: str | None = None, readable_log: bool = False) -> int:
        seen.update(scenario=scenario, config=config)
        return 0

    monkeypatch.setattr(proxy.demo, "demo_main", fake_demo_main)
    config = tmp_path / "tenants.json"
    config.write_text('{"proxy": {"queue_timeout_s": 7}}')
    assert main(["demo", "--check", "--config", str(config)]) == 0
    assert seen == {"scenario": "default", "config": str(config)}, "--config must reach the demo"


def test_demo_config_with_no_proxy_is_refused_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tenants.json"
    config.write_text("{}")
    assert main(["demo", "--no-proxy", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "--no-proxy" in err and "--config" in err and "Traceback" not in err, err


async def test_demo_config_applies_its_settings_over_the_scenario_and_health_says_so(
        box: DemoFactory, tmp_path: Path, http: httpx.AsyncClient) -> None:
    config = tmp_path / "tenants.json"
    config.write_text(json.dumps({
        "proxy": {"queue_timeout_s": 7},
        "telemetry": {"retention_days": 3},
        "tenants": {"comfyui": {"priority": 90, "upstream": "http://127.0.0.1:8188"},
                    "ollama": {"idle_release_after_s": 42}},
    }))
    demo = await box("default", config=config, scenario_name="default")
    assert demo.proxy is not None and demo.box.comfyui is not None
    cfg = proxy_of(demo).registry.config
    assert cfg.proxy.queue_timeout_s == 7 and cfg.telemetry.retention_days == 3, "the file's sections apply"
    assert cfg.tenants["comfyui"].priority == 90 and cfg.tenants["ollama"].idle_release_after_s == 42
    assert cfg.tenants["comfyui"].upstream == demo.box.servers["comfyui"].url, "the simulator stays the upstream"
    assert cfg.tenants["ollama"].model_paths, "the scenario's own settings stay where the file says nothing"
    health = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    entry = next(e for e in health["entries"] if e["name"] == "configuration")
    assert str(config) in entry["problem"] and "scenario 'default'" in entry["problem"], entry
    assert "shipped defaults" not in entry["problem"], f"the demo claims shipped defaults while given a file: {entry}"
    assert f"configuration: {config}" in describe(demo, "default")


async def test_demo_without_config_says_it_runs_the_scenario_over_the_shipped_defaults(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default", scenario_name="default")
    assert demo.proxy is not None
    health = (await http.get(proxy_of(demo).url("admin") + "/api/health")).json()
    entry = next(e for e in health["entries"] if e["name"] == "configuration")
    assert "scenario 'default'" in entry["problem"] and "no tenants.json read" in entry["problem"], entry


async def test_the_first_try_line_works_from_any_folder(box: DemoFactory, tmp_path: Path) -> None:
    demo = await box("default")
    text = describe(demo, "default")
    line = next(x for x in text.splitlines() if "/prompt -d @" in x)
    command = line.split("#")[0].strip()
    path = Path(command.split("-d @")[1].split()[0])
    assert path.is_absolute() and await asyncio.to_thread(path.exists), f"the Try line names {path}: no such file"
    assert demo.workdir is not None and path.parent == demo.workdir, "a file of the demo's own, removed when it stops"
    # Run as printed, from a folder that is not the checkout.
    done = await asyncio.to_thread(subprocess.run, shlex.split(command), capture_output=True, text=True,
                                   timeout=30, cwd=tmp_path)
    assert done.returncode == 0 and "prompt_id" in done.stdout, (done.stdout, done.stderr)


# -- hyperswap check --------------------------------------------------------------------------------

def test_check_without_a_proxy_exits_2_as_its_help_and_the_cli_reference_say() -> None:
    done = hyperswap("check", "--admin", "http://127.0.0.1:9")
    assert done.returncode == 2, done
    assert "no HyperSwap proxy answers" in done.stderr and "Traceback" not in done.stderr
    helped = " ".join(hyperswap("check", "--help").stdout.split())
    assert "2 when no proxy answers" in helped and "1 when one did" in helped, helped
    said = " ".join(CLI_PAGE.split("`hyperswap check`", 1)[1].split("\n- ", 1)[0].split())
    assert "2 when no proxy answers" in said and "1 when one did" in said, f"docs/reference/cli.md says: {said}"


# -- hyperswap plan ---------------------------------------------------------------------------------

def test_plan_needs_tenant_and_its_usage_says_so() -> None:
    done = hyperswap("plan")
    assert done.returncode == 2 and "--tenant" in done.stderr and "required" in done.stderr, done
    usage = hyperswap("plan", "--help").stdout
    assert re.search(r"(?<!\[)--tenant NAME", usage) and "[--tenant" not in usage, usage


async def test_plan_lists_the_requesters_own_processes_apart_from_its_blockers(
        box: DemoFactory, http: httpx.AsyncClient, capsys: pytest.CaptureFixture[str]) -> None:
    demo = await box("tight")
    assert demo.proxy is not None and demo.box.ollama is not None
    small = min((m for m in ollama_of(demo).config.models if "completion" in m.capabilities), key=lambda m: m.size_bytes)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": small.name, "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    admin = proxy_of(demo).url("admin")
    rc = await asyncio.to_thread(main, ["plan", "--tenant", "ollama", "--need-gb", "15", "--admin", admin, "--json"])
    body = json.loads(capsys.readouterr().out)
    assert rc == 1 and any(b["reason"] == "requester" for b in body["plan"]["blockers"]), body["plan"]["blockers"]
    await asyncio.to_thread(main, ["plan", "--tenant", "ollama", "--need-gb", "15", "--admin", admin])
    out = capsys.readouterr().out
    blockers = [x for x in out.splitlines() if x.strip().startswith("blocker")]
    assert blockers and not [x for x in blockers if " ollama " in x], f"ollama's own runner listed as a blocker:\n{out}"
    assert any(x.strip().startswith("held") and "ollama" in x for x in out.splitlines()), out


# -- hyperswap tenants ------------------------------------------------------------------------------

def test_tenants_shows_the_proxy_admin_and_telemetry_sections_with_their_sources(tmp_path: Path) -> None:
    config = tmp_path / "tenants.json"
    config.write_text('{"proxy": {"queue_timeout_s": 60}}')
    out = hyperswap("tenants", "--config", str(config)).stdout
    for section in ("admin", "proxy", "telemetry"):
        assert re.search(rf"^{section}$", out, re.M), f"no {section} section:\n{out}"
    line = next(x for x in out.splitlines() if x.strip().startswith("queue_timeout_s"))
    assert "60" in line and "[user]" in line, line
    assert "[default]" in next(x for x in out.splitlines() if x.strip().startswith("starvation_after_s"))
    body = json.loads(hyperswap("tenants", "--config", str(config), "--json").stdout)
    assert body["settings"]["proxy"]["config"]["queue_timeout_s"] == 60
    assert body["settings"]["proxy"]["sources"]["queue_timeout_s"] == "user"
    assert body["settings"]["admin"]["sources"]["listen"] == "default"


# -- hyperswap install ------------------------------------------------------------------------------

def _install(tmp_path: Path, *extra: str) -> list[str]:
    return ["install", "--root", str(tmp_path / "root"), *extra]


@pytest.mark.parametrize("dry_run", [True, False])
def test_install_from_a_venv_under_tmp_is_refused_as_the_service_could_not_see_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dry_run: bool) -> None:
    monkeypatch.setattr(install, "exec_argv", lambda: ["/tmp/hs-venv/bin/hyperswap"])
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # install's own os
    monkeypatch.setattr(install, "SystemRunner", lambda: pytest.fail("nothing may run"))
    # onto this machine (root /), where the refusal applies; should it ever not, the files still go
    # to the test's folder, never to /etc
    real_files = install.Files
    monkeypatch.setattr(install, "Files", lambda root: real_files(tmp_path / "root"))
    rc = main(["install", *(["--dry-run"] if dry_run else [])])
    captured = capsys.readouterr()
    assert rc == 1, captured
    assert "PrivateTmp=yes" in captured.err and "/tmp/hs-venv/bin/hyperswap" in captured.err, captured.err
    assert "fix:" in captured.err
    assert "pip install hyperswap`" not in captured.err, "no package index has hyperswap: name a command that works"
    checkout = Path(install.__file__).resolve().parents[2]
    assert f"/opt/hyperswap/bin/pip install {checkout}`" in captured.err, captured.err
    assert not (tmp_path / "root" / "etc").exists(), "nothing written"
    if dry_run:
        assert "would write" in captured.out, "the dry run still shows the plan"


def test_a_user_install_from_tmp_is_allowed_with_a_note_that_tmp_is_emptied_at_boot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(install, "exec_argv", lambda: ["/var/tmp/hs-venv/bin/hyperswap"])
    assert main(_install(tmp_path, "--user", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "by hand: the service runs /var/tmp/hs-venv/bin/hyperswap, under /var/tmp" in out, out


def test_into_another_root_a_program_under_tmp_is_a_note_not_a_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--root packages an install for another system (or a test's folder): this machine's /tmp says
    nothing of that system's, so the plan notes where the unit's program lies and goes on."""
    monkeypatch.setattr(install, "exec_argv", lambda: ["/tmp/hs-venv/bin/hyperswap"])
    assert main(_install(tmp_path, "--dry-run")) == 0
    assert "the service runs /tmp/hs-venv/bin/hyperswap, under /tmp" in capsys.readouterr().out


def test_install_from_elsewhere_is_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(install, "exec_argv", lambda: ["/opt/hyperswap/bin/hyperswap"])
    assert main(_install(tmp_path, "--dry-run")) == 0
    assert "PrivateTmp" not in capsys.readouterr().err


# -- the 503 after a queue timeout ----------------------------------------------------------------

async def test_the_503_after_a_queue_timeout_says_how_long_it_waited_once(box: DemoFactory,
                                                                          http: httpx.AsyncClient) -> None:
    demo = await box(fast_scenario("default", settings={"proxy": {"queue_timeout_s": 1}},
                                   comfyui={"step_time_s": 0.5}))
    assert demo.proxy is not None and demo.box.comfyui is not None
    render = asyncio.ensure_future(run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http, 60))
    try:
        await poll_until(lambda: proxy_of(demo).inflight.traffic("comfyui").jobs, 0.01)
        r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                            json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    finally:
        render.cancel()
    body = r.json()
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert len(re.findall(r"\bwait", body["error"])) == 1, f"the wait told more than once: {body['error']}"
    assert body["error"].startswith("ollama waited 1 s for GPU memory") and "comfyui" in body["error"], body["error"]


def test_the_install_command_the_refusal_names_is_the_checkout_or_a_built_wheel() -> None:
    from proxy import __version__

    text = install.install_command(Path("/src/hyperswap"))
    assert "/opt/hyperswap/bin/pip install /src/hyperswap`" in text, text
    assert f"hyperswap-{__version__}-py3-none-any.whl" in text and "pip wheel --no-deps ." in text, text


# -- the service's state directory (issue 42) ----------------------------------------------------------

def _unit_from_dry_run(out: str) -> str:
    """The unit text a dry run prints under `would write ...hyperswap.service` (indented 4)."""
    block = out.split("hyperswap.service    #", 1)[1].split("\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    return "\n".join(lines)


def _writable_under(unit: str, path: Path, state_base: str) -> bool:
    """Whether the service may write `path`, by the sandbox options the unit sets (systemd.exec(5)):
    ProtectSystem= makes /usr, /boot, /efi (and with full, /etc; with strict, all) read-only;
    ProtectHome= makes /home, /root, /run/user read-only or empty; StateDirectory= is writable."""
    keys: dict[str, list[str]] = {}
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            keys.setdefault(key.strip(), []).append(value.strip())
    text = str(path)
    if any(text == f"{state_base}/{d}" or text.startswith(f"{state_base}/{d}/") for d in keys.get("StateDirectory", [])):
        return True
    system = (keys.get("ProtectSystem") or ["no"])[-1]
    home = (keys.get("ProtectHome") or ["no"])[-1]
    read_only = ["/usr", "/boot", "/efi"] + (["/etc"] if system in ("full", "strict") else [])
    if system == "strict":
        read_only = ["/"]
    if home in ("yes", "read-only", "tmpfs"):
        read_only += ["/home", "/root", "/run/user"]
    return not any(text == r or text.startswith(r.rstrip("/") + "/") for r in read_only)


def test_the_system_unit_a_real_install_dry_run_prints_lets_the_proxy_write_its_lifecycle_records(
        tmp_path: Path) -> None:
    """Issue 42: under the shipped service the records of the apps it starts could not be written (its
    home is read-only), so a crashed run's leftovers were never cleaned. The real command's unit gives
    the proxy a state directory, and the proxy's state path under the environment systemd gives it
    (HOME=/root, STATE_DIRECTORY=/var/lib/<StateDirectory>) is inside it."""
    from proxy.lifecycle.build import default_state_dir

    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "install", "--root", str(tmp_path / "root"), "--dry-run"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    unit = _unit_from_dry_run(done.stdout)
    assert "ProtectHome=read-only" in unit and "[Service]" in unit, unit
    dirs = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("StateDirectory=")]
    assert dirs, f"the unit has no StateDirectory=: nothing writable for the records\n{unit}"
    service_env = {"HOME": "/root", "STATE_DIRECTORY": ":".join(f"/var/lib/{d}" for d in dirs)}
    state = default_state_dir(service_env)
    assert _writable_under(unit, state, "/var/lib"), f"{state} is read-only for the service\n{unit}"
    assert not _writable_under(unit, default_state_dir({"HOME": "/root"}), "/var/lib"), \
        "the check itself: the home the proxy used before is read-only under this unit"
