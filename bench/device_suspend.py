"""CUDA suspend and restore on a REAL card: what `cuda_suspend` would do to an app, measured.

Not a test, and nothing here runs in CI (it needs an NVIDIA GPU, driver 570+ for the driver API or
550+ with cuda-checkpoint on PATH for `--via utility`). On a GPU machine, from the repository root:

    python3 bench/device_suspend.py [--gib 4] [--rounds 3] [--via driver|utility] [--engine-pid PID]

It starts a small CUDA program of its own (Python and ctypes on libcuda.so.1: no compiler, no
package), which allocates `--gib` GiB on card 0 and fills it with a pattern; then, each round:
reads the card (nvidia-smi), suspends the program through proxy/lifecycle/cuda_driver.py (the code
the proxy runs), reads the card again (the program's memory must be gone), asks the program to read
its memory (the CUDA call must block while suspended), restores it, and checks the pattern came
back. It prints one JSON object and writes it to $OUT/device_suspend.json when $OUT is set (the
`device` tool's folder). `--engine-pid` also suspends and restores a running engine (Ollama's runner,
ComfyUI) with its model loaded, and times it. Exit 0 when every round restored the data intact.

Record its figures in docs/results.md only from a run on a card, naming the card and the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.errors import ConfigError  # noqa: E402
from proxy.lifecycle.cuda_driver import Checkpointer, checkpointer_for, driver_version  # noqa: E402

GIB = 2**30

# The small CUDA program: allocate, fill, then on each line read back the last 4 KiB and say OK/BAD.
CHILD = r"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
P, S = ctypes.c_uint64, ctypes.c_size_t
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(P), S]
cu.cuMemsetD8_v2.argtypes = [P, ctypes.c_ubyte, S]
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, P, S]
def ok(code, what):
    if code:
        print(f"ERR {what} {code}", flush=True)
        sys.exit(1)
ok(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
n = int(sys.argv[1])
ptr = P()
ok(cu.cuMemAlloc_v2(ctypes.byref(ptr), n), "cuMemAlloc")
ok(cu.cuMemsetD8_v2(ptr, 0x5A, n), "cuMemsetD8")
ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
print("READY", flush=True)
for _ in sys.stdin:
    buf = (ctypes.c_ubyte * 4096)()
    ok(cu.cuMemcpyDtoH_v2(buf, P(ptr.value + n - 4096), 4096), "cuMemcpyDtoH")
    print("OK" if all(b == 0x5A for b in buf) else "BAD", flush=True)
"""


def smi() -> dict[str, Any]:
    """The card and its compute processes as nvidia-smi reads them (MiB)."""
    def query(what: str, fields: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    gpu = query("gpu", "name,driver_version,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current")
    apps = query("compute-apps", "pid,used_memory")
    return {"gpu": gpu[0] if gpu else None, "apps": {int(p): int(m) for p, m in apps if p.isdigit() and m.isdigit()}}


def answer_within(proc: subprocess.Popen[str], seconds: float) -> str | None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().strip() if ready else None


async def one_round(driver: Checkpointer, proc: subprocess.Popen[str], nbytes: int) -> dict[str, Any]:
    assert proc.stdin is not None
    before = smi()
    t = time.perf_counter()
    await driver.suspend(proc.pid, 30.0)
    suspend_s = time.perf_counter() - t
    during = smi()
    proc.stdin.write("check\n")
    proc.stdin.flush()
    blocked = answer_within(proc, 1.0) is None  # a CUDA call of a suspended process blocks
    t = time.perf_counter()
    await driver.restore(proc.pid)
    restore_s = time.perf_counter() - t
    intact = answer_within(proc, 30.0) if blocked else "answered while suspended"
    after = smi()
    return {"suspend_s": round(suspend_s, 3), "restore_s": round(restore_s, 3),
            "suspend_gbps": round(nbytes / suspend_s / 1e9, 2), "restore_gbps": round(nbytes / restore_s / 1e9, 2),
            "blocked_while_suspended": blocked, "data_after_restore": intact,
            "card_mib": {"before": before["gpu"], "suspended": during["gpu"], "after": after["gpu"]},
            "process_mib": {"before": before["apps"].get(proc.pid), "suspended": during["apps"].get(proc.pid),
                            "after": after["apps"].get(proc.pid)}}


async def engine(driver: Checkpointer, pid: int) -> dict[str, Any]:
    held = smi()["apps"].get(pid)
    t = time.perf_counter()
    await driver.suspend(pid, 30.0)
    s = time.perf_counter() - t
    t = time.perf_counter()
    await driver.restore(pid)
    r = time.perf_counter() - t
    out: dict[str, Any] = {"pid": pid, "held_mib": held, "suspend_s": round(s, 3), "restore_s": round(r, 3)}
    if held:
        out.update({"suspend_gbps": round(held * 2**20 / s / 1e9, 2), "restore_gbps": round(held * 2**20 / r / 1e9, 2)})
    return out


def main(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"driver": driver_version(), "via": args.via, "gib": args.gib, "rounds": []}
    try:
        driver = checkpointer_for(args.via, "cuda-checkpoint", os.environ)
    except ConfigError as exc:
        report["refused"] = {"error": str(exc), "fix": exc.fix}
        print(json.dumps(report, indent=2))
        return 2
    nbytes = int(args.gib * GIB)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(nbytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        first = answer_within(proc, 120.0)
        if first != "READY":
            report["child"] = first
            print(json.dumps(report, indent=2))
            return 1
        for _ in range(args.rounds):
            report["rounds"].append(asyncio.run(one_round(driver, proc, nbytes)))
        if args.engine_pid:
            report["engine"] = asyncio.run(engine(driver, args.engine_pid))
    finally:
        proc.kill()
        proc.wait()
    ok = all(r["blocked_while_suspended"] and r["data_after_restore"] == "OK" for r in report["rounds"])
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_suspend.json").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="GiB the small CUDA program holds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--via", choices=("driver", "utility"), default="driver")
    parser.add_argument("--engine-pid", type=int, default=None, help="also suspend/restore this running engine")
    sys.exit(main(parser.parse_args()))
