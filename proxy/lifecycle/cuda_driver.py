"""The seam to NVIDIA's CUDA checkpointing: suspend a CUDA process from outside it and restore it.

Facts (NVIDIA's CUDA driver API reference, "CUDA Checkpointing", and github.com/NVIDIA/cuda-checkpoint):
- `CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)` (args optional; its
  `timeoutMs`, 0 = none), `cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *)`
  (the process must be LOCKED: device memory is copied into host memory the driver manages and
  every GPU resource is released), `cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *)`
  (from CHECKPOINTED), `cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *)`,
  `cuCheckpointProcessGetState(int pid, CUprocessState *)` (RUNNING 0, LOCKED 1, CHECKPOINTED 2,
  FAILED 3) and `cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)`. Linux only. The driver
  functions came with display driver 570 (CUDA 12.8); the `cuda-checkpoint` utility, which wraps the
  same driver support, works from driver 550 (`--toggle --pid P`, `--get-state --pid P`).
- CPU threads of a suspended process keep running; a CUDA call blocks until the restore.
- The API needs `cuInit(0)` in the caller and nothing more: no context is created in the proxy, so
  it holds no memory on the card.

Three implementations of one small async protocol (`Checkpointer`): the driver API through ctypes
(`DriverApi`, the default), the utility (`CheckpointUtility`, `via: "utility"`), and the demo's
(`proxy/sim/checkpoint.py`). `checkpointer_for` builds the real ones and refuses, at the proxy's
start, a driver too old or without the API, with the fix.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, Protocol

from proxy.errors import ConfigError

ProcessState = Literal["running", "locked", "checkpointed", "failed", "not_cuda", "gone"]
STATES: tuple[ProcessState, ...] = ("running", "locked", "checkpointed", "failed")  # CUprocessState's order
UTILITY_MIN_DRIVER = 550  # the cuda-checkpoint utility
API_MIN_DRIVER = 570  # cuCheckpointProcess* in libcuda (CUDA 12.8)
DRIVER_VERSION_FILES = ("/sys/module/nvidia/version", "/proc/driver/nvidia/version")


class CheckpointError(Exception):
    """A suspend or restore the driver refused, with what to do about it."""

    def __init__(self, message: str, fix: str | None = None, *, not_cuda: bool = False, gone: bool = False) -> None:
        super().__init__(message)
        self.fix = fix
        self.not_cuda = not_cuda  # the process has no CUDA state to suspend
        self.gone = gone  # the process no longer exists


class Checkpointer(Protocol):
    """Suspends and restores one CUDA process. Every call may take seconds: none blocks the loop."""

    via: str  # shown in decisions and views: "driver API", "cuda-checkpoint", "simulated"

    async def state(self, pid: int) -> ProcessState: ...

    async def suspend(self, pid: int, lock_timeout_s: float) -> None:
        """Lock, then checkpoint (device memory into host RAM). Raises CheckpointError."""

    async def restore(self, pid: int) -> None:
        """Restore, then unlock. Raises CheckpointError."""

    def host_available_bytes(self) -> int | None:
        """Host RAM the next suspend may fill (MemAvailable); None when unknown."""


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def driver_version(files: tuple[str, ...] = DRIVER_VERSION_FILES) -> str | None:
    """The NVIDIA kernel driver's version ("570.86.10"), from sysfs or /proc; None without one."""
    for name in files:
        try:
            text = Path(name).read_text()
        except OSError:
            continue
        found = re.search(r"\b(\d{3,})\.\d+(?:\.\d+)?\b", text)
        if found:
            return found.group(0)
    return None


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


# -- the driver API through ctypes ------------------------------------------------------------------

class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
API_SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
               "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")


class DriverApi:
    """`cuCheckpointProcess*` on libcuda.so.1 through ctypes: no binding package, no CUDA context
    (only `cuInit(0)`), each call in a worker thread."""

    via = "driver API"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._init = False

    def _call(self, name: str, pid: int, arg: object = None) -> int:
        if not self._init:
            self._lib.cuInit(0)
            self._init = True
        fn = getattr(self._lib, name)
        return int(fn(ctypes.c_int(pid), arg))

    def _error(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            self._lib.cuGetErrorName(code, ctypes.byref(text))
        except AttributeError:
            return f"CUresult {code}"
        return (text.value or b"").decode() or f"CUresult {code}"

    def _state_now(self, pid: int) -> ProcessState:
        if not _pid_alive(pid):
            return "gone"
        out = ctypes.c_int(-1)
        code = self._call("cuCheckpointProcessGetState", pid, ctypes.byref(out))
        if code != CUDA_SUCCESS:
            return "gone" if not _pid_alive(pid) else "not_cuda"
        return STATES[out.value] if 0 <= out.value < len(STATES) else "failed"

    def _step(self, name: str, pid: int, arg: object = None) -> None:
        code = self._call(name, pid, arg)
        if code != CUDA_SUCCESS:
            gone = not _pid_alive(pid)
            raise CheckpointError(f"{name}({pid}) failed: {'the process exited' if gone else self._error(code)}",
                                  gone=gone)

    def _suspend_now(self, pid: int, lock_timeout_s: float) -> None:
        state = self._state_now(pid)
        if state != "running":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}, not a running CUDA process",
                                  not_cuda=state == "not_cuda", gone=state == "gone")
        args = _LockArgs(timeoutMs=max(1, int(lock_timeout_s * 1000)))
        self._step("cuCheckpointProcessLock", pid, ctypes.byref(args))
        try:
            self._step("cuCheckpointProcessCheckpoint", pid)
        except CheckpointError:
            self._call("cuCheckpointProcessUnlock", pid)  # a locked process must not stay locked
            raise

    def _restore_now(self, pid: int) -> None:
        state = self._state_now(pid)
        if state == "checkpointed":
            self._step("cuCheckpointProcessRestore", pid)
            state = "locked"
        if state == "locked":
            self._step("cuCheckpointProcessUnlock", pid)
        elif state != "running":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}: nothing to restore", gone=state == "gone")

    async def state(self, pid: int) -> ProcessState:
        return await asyncio.to_thread(self._state_now, pid)

    async def suspend(self, pid: int, lock_timeout_s: float) -> None:
        await asyncio.to_thread(self._suspend_now, pid, lock_timeout_s)

    async def restore(self, pid: int) -> None:
        await asyncio.to_thread(self._restore_now, pid)

    def host_available_bytes(self) -> int | None:
        return host_available_bytes()


# -- the cuda-checkpoint utility -------------------------------------------------------------------

class CheckpointUtility:
    """`cuda-checkpoint --toggle --pid P` (driver 550+), its state read with `--get-state --pid P`."""

    via = "cuda-checkpoint"

    def __init__(self, program: str, timeout_s: float = 120.0) -> None:
        self.program = program
        self.timeout_s = timeout_s

    async def _run(self, *args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(self.program, *args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, f"{self.program} {' '.join(args)} ran past {self.timeout_s:g} s"
        return proc.returncode or 0, out.decode("utf-8", "replace").strip()

    async def state(self, pid: int) -> ProcessState:
        if not _pid_alive(pid):
            return "gone"
        rc, out = await self._run("--get-state", "--pid", str(pid))
        if rc != 0:
            return "gone" if not _pid_alive(pid) else "not_cuda"
        word = out.split()[-1].lower() if out else ""
        return next((s for s in STATES if s == word), "failed")

    async def _toggle(self, pid: int, want: ProcessState) -> None:
        rc, out = await self._run("--toggle", "--pid", str(pid))
        if rc != 0:
            gone = not _pid_alive(pid)
            raise CheckpointError(f"cuda-checkpoint --toggle --pid {pid} failed: {out or f'exit {rc}'}", gone=gone)
        now = await self.state(pid)
        if now != want:
            raise CheckpointError(f"process {pid} is {now} after cuda-checkpoint --toggle, not {want}")

    async def suspend(self, pid: int, lock_timeout_s: float) -> None:
        state = await self.state(pid)
        if state != "running":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}, not a running CUDA process",
                                  not_cuda=state == "not_cuda", gone=state == "gone")
        await self._toggle(pid, "checkpointed")

    async def restore(self, pid: int) -> None:
        state = await self.state(pid)
        if state != "checkpointed":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}: nothing to restore", gone=state == "gone")
        await self._toggle(pid, "running")

    def host_available_bytes(self) -> int | None:
        return host_available_bytes()


# -- building one, refused at the proxy's start when it cannot work ---------------------------------

def _major(version: str | None) -> int | None:
    try:
        return int(version.split(".")[0]) if version else None
    except ValueError:
        return None


def checkpointer_for(via: Literal["driver", "utility"], utility: str, env: Mapping[str, str], *,
                     load: Callable[[str], ctypes.CDLL] = ctypes.CDLL, version: str | Literal["read"] | None = "read",
                     platform: str = sys.platform) -> DriverApi | CheckpointUtility:
    """The real checkpointer a `cuda_suspend` step asks for. Raises ConfigError (the proxy does not
    start) when it cannot work here: not Linux, no NVIDIA driver, a driver older than 550 (570 for the
    driver API), a libcuda without the checkpoint functions, the utility not found."""
    where = "a tenant's release step of kind cuda_suspend"
    if not platform.startswith("linux"):
        raise ConfigError(f"{where} needs Linux: CUDA checkpointing is Linux only (this is {platform})",
                          fix="use another release kind (comfyui_free, http, process) on this machine")
    found = driver_version() if version == "read" else version
    major = _major(found)
    need = API_MIN_DRIVER if via == "driver" else UTILITY_MIN_DRIVER
    if major is not None and major < need:
        other = (" or set release.via to \"utility\" with cuda-checkpoint (driver 550+)"
                 if via == "driver" and major >= UTILITY_MIN_DRIVER else "")
        raise ConfigError(f"{where} needs NVIDIA driver {need} or newer; this machine runs {found}",
                          fix=f"update the NVIDIA driver to {need}+{other}, or remove cuda_suspend from the release list")
    if via == "utility":
        program = shutil.which(utility, path=env.get("PATH", os.defpath))
        if program is None:
            raise ConfigError(f"{where} uses the cuda-checkpoint utility, but {utility!r} is not found on PATH",
                              fix="install it from github.com/NVIDIA/cuda-checkpoint (bin/x86_64_Linux) and give its "
                                  "path in release.utility, or set release.via to \"driver\" (driver 570+)")
        return CheckpointUtility(program)
    try:
        lib = load("libcuda.so.1")
    except OSError as exc:
        raise ConfigError(f"{where} needs the NVIDIA driver's libcuda.so.1, which does not load: {exc}",
                          fix="install the NVIDIA driver (570+), or remove cuda_suspend from the release list") from None
    missing = [name for name in API_SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise ConfigError(f"{where}: this driver's libcuda has no CUDA checkpoint API ({', '.join(missing)} missing; "
                          f"driver {found or 'of unknown version'})",
                          fix="update the NVIDIA driver to 570+ (CUDA 12.8), or set release.via to \"utility\" "
                              "with cuda-checkpoint (driver 550+)")
    return DriverApi(lib)
