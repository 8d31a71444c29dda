"""SystemdController against a fake `systemctl` that records its calls and keeps unit states in a file."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.engines.loading import registry_from_dict
from proxy.lifecycle import LifecycleError, SystemdController
from proxy.lifecycle.systemd import SystemdRelease

FAKE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    state_file = Path(sys.argv[1])
    args = sys.argv[2:]
    state = json.loads(state_file.read_text())
    state.setdefault("calls", []).append(args)
    units = state["units"]
    scope = "user" if args[0] == "--user" else "system"
    args = args[1:] if scope == "user" else args
    assert args[-2] == "--", args  # the unit always comes after --
    verb, unit = args[0], args[-1]
    known = unit in units.get(scope, {})
    def done(code, out=""):
        state_file.write_text(json.dumps(state))
        print(out, end="")
        sys.exit(code)
    if verb in ("start", "stop"):
        if not known:
            done(5, f"Failed to {verb} {unit}: Unit {unit} not found.\\n")
        if verb == "start" and state.get("start_fails"):
            done(1, f"Job for {unit} failed because the control process exited with error code.\\n"
                    f"See \\"systemctl status {unit}\\" and \\"journalctl -xeu {unit}\\" for details.\\n")
        units[scope][unit] = "active" if verb == "start" else "inactive"
        done(0)
    if verb == "is-active":
        now = units.get(scope, {}).get(unit, "inactive")
        done(0 if now == "active" else 3, now + "\\n")
    if verb == "show":
        done(0, ("loaded" if known else "not-found") + "\\n")
    done(1, f"unknown verb {verb}\\n")
""")


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    script = tmp_path / "systemctl.py"
    script.write_text(FAKE)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"units": {"system": {"comfyui.service": "inactive"},
                                           "user": {"tts.service": "active"}}}))
    return state


def systemctl(state: Path) -> list[str]:
    return [sys.executable, str(state.parent / "systemctl.py"), str(state)]


def make_starts_fail(state: Path) -> None:
    state.write_text(json.dumps({**json.loads(state.read_text()), "start_fails": True}))


def calls(state: Path) -> list[list[str]]:
    return list(json.loads(state.read_text()).get("calls", []))


async def test_start_stop_and_status_go_through_systemctl(fake: Path) -> None:
    ctl = SystemdController("comfyui.service", systemctl=systemctl(fake))
    assert await ctl.status() == "stopped"
    await ctl.start()
    assert await ctl.status() == "running"
    await ctl.stop()
    assert await ctl.status() == "stopped"
    assert calls(fake) == [["is-active", "--", "comfyui.service"], ["start", "--", "comfyui.service"],
                           ["is-active", "--", "comfyui.service"], ["stop", "--", "comfyui.service"],
                           ["is-active", "--", "comfyui.service"]]
    assert await ctl.check() == []
    await ctl.aclose()
    assert calls(fake)[-1][0] == "show", "closing leaves the unit alone"


async def test_scope_user_talks_to_the_users_manager_and_a_running_unit_is_adopted(fake: Path) -> None:
    reg = registry_from_dict({"tenants": {"tts": {"upstream": "http://127.0.0.1:5002", "release": {
        "kind": "systemd", "unit": "tts.service", "scope": "user"}}}})
    spec = reg.get("tts").lifecycle
    assert isinstance(spec, SystemdRelease), spec
    ctl = SystemdController.from_spec(spec, systemctl=systemctl(fake))
    assert await ctl.status() == "running"
    assert calls(fake) == [["--user", "is-active", "--", "tts.service"]]


async def test_a_failing_start_says_why_and_where_to_look(fake: Path) -> None:
    make_starts_fail(fake)
    ctl = SystemdController("comfyui.service", systemctl=systemctl(fake))
    with pytest.raises(LifecycleError) as err:
        await ctl.start()
    assert "`systemctl start comfyui.service` failed (exit 1)" in err.value.message
    assert err.value.fix is not None and "journalctl -u comfyui.service" in err.value.fix
    assert "polkit" in err.value.fix, "a system unit needs the proxy's user allowed to manage it"
    assert any("control process exited" in line for line in err.value.output)


async def test_an_unknown_unit_is_named_by_check_and_start(fake: Path) -> None:
    ctl = SystemdController("llama.service", systemctl=systemctl(fake))
    problems = await ctl.check()
    assert problems and problems[0].startswith("unit llama.service is not known to systemd (system scope)")
    with pytest.raises(LifecycleError, match=r"Unit llama\.service not found"):
        await ctl.start()


async def test_no_systemctl_is_a_clear_error(tmp_path: Path) -> None:
    ctl = SystemdController("comfyui.service", systemctl=str(tmp_path / "systemctl"))
    with pytest.raises(LifecycleError) as err:
        await ctl.start()
    assert err.value.fix is not None and "use release kind process or docker" in err.value.fix
    assert await ctl.status() == "unknown"
