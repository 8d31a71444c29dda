"""`pip wheel .` builds an honest wheel, and `hyperswap demo --check --fast` passes when installed from it alone.

`--fast` runs the same checks with the simulated engines' delays cut to milliseconds (9 s instead of 90 s):
what this test proves is the packaging (shipped files, entry point, scenarios), not the engines' timing.

Offline: the wheel is built without build isolation (setuptools and wheel come from the test extra),
installed with --no-deps into a fresh venv that sees this environment's site-packages for the
dependencies (a .pth line: their .pth files, such as this checkout's editable install, are not
run, so `proxy` can only come from the wheel). `demo --check` listens on fixed ports (11435,
8189, 11400, 21434, 28188), so it runs in a network namespace of its own (`unshare --net`).
"""

from __future__ import annotations

import shutil
import site
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _own_netns_works() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip not installed (util-linux, iproute2)"
    done = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"cannot make a network namespace here: {done.stderr.strip()}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")  # keep build/ out of the checkout
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, check=False, cwd=build,
                          timeout=300)
    assert done.returncode == 0, f"pip wheel . failed:\n{done.stdout}\n{done.stderr}"
    (found,) = out.glob("hyperswap-*.whl")
    return found


def test_the_wheel_holds_the_shipped_files_as_real_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        infos = {i.filename: i for i in z.infolist()}
        links = [n for n, i in infos.items() if stat.S_ISLNK(i.external_attr >> 16)]
        assert links == [], f"symlinks in the wheel: {links}"
        # proxy/defaults/tenants.json is a symlink to the root tenants.json in the checkout: the wheel must carry the bytes
        assert z.read("proxy/defaults/tenants.json") == (ROOT / "tenants.json").read_bytes()
        for static in sorted((ROOT / "proxy/admin/dashboard/static").iterdir()):
            assert z.read(f"proxy/admin/dashboard/static/{static.name}") == static.read_bytes(), static.name
        for scenario in sorted((ROOT / "examples/scenarios").glob("*.json")):
            assert z.read(f"proxy/sim/scenarios/{scenario.name}") == scenario.read_bytes(), scenario.name
        for unit in ("hyperswap.service", "hyperswap-user.service"):
            assert f"proxy/deploy/units/{unit}" in infos, unit


def test_demo_check_passes_from_the_wheel_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    reason = _own_netns_works()
    if reason:
        pytest.skip(reason)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q",
                           "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    where = subprocess.run([str(venv / "bin/python"), "-c", "import proxy; print(proxy.__file__)"], capture_output=True,
                           text=True, check=True, cwd=tmp_path).stdout.strip()
    assert where.startswith(str(purelib)), f"proxy imported from {where}, not from the installed wheel"
    done = subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {venv}/bin/hyperswap demo --check --fast"],
                          capture_output=True, text=True, check=False, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, (f"demo --check --fast from the wheel failed ({done.returncode}):\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
