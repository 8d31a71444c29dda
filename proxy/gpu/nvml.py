"""The NVML reader: every device's memory and processes through nvidia-ml-py (`pynvml`).

One device (a one-GPU host, or `index` given) gives the snapshot it always did. Several give one
snapshot with every device in `GpuSnapshot.devices` and each process entry tagged with its device
(a process on two cards: two entries), plus, for placing tenants on cards (proxy/gpu/devices.py),
the CUDA device variables of each GPU process's lineage from /proc/<pid>/environ.

Blocking (C calls and /proc reads): callers run `read()` off the event loop, one at a time.
Every failure becomes a `GpuReadError` with a health state and a fix; nothing else escapes `read()`.

Process tree: the GPU processes' ancestors and the listening sockets they hold
(`proxy.gpu.proctree`), read once per snapshot in the same thread, so attribution can go by the
tenant's upstream port without touching /proc on the event loop.

Process start time: field 22 of /proc/<pid>/stat (`starttime`, clock ticks since boot) divided by
SC_CLK_TCK, so `GpuProcess.start_time` is float seconds since boot. With the pid it identifies a
process across PID reuse; it is not a wall-clock time.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Literal, Protocol

from proxy.clock import Clock, SystemClock
from proxy.gpu.devices import lineage_cuda_env
from proxy.gpu.proctree import FdLinks, ProcTreeReader, read_fd_links
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuReadError, GpuSnapshot, ProcessTree

CONTAINER_NOTE = ("GPU processes are not visible in this PID namespace (container?): "
                  "run with --pid=host / hostPID: true for per-process attribution")

_FIXES: dict[str, str] = {
    "library_missing": ("install the NVIDIA driver (it ships libnvidia-ml.so.1) and nvidia-ml-py; in a container, "
                        "run with the NVIDIA container toolkit (--gpus all) so the library is mounted, "
                        "or run outside the container"),
    "driver_not_loaded": "load the NVIDIA kernel driver (reboot, or `sudo modprobe nvidia`) and check `nvidia-smi`",
    "no_permission": "run as a user that can open /dev/nvidia* (the video group), or check the container's device access",
    "gpu_lost": "the GPU fell off the bus: reboot the machine (and check power and cooling)",
    "driver_mismatch": "reboot after the driver update, so the loaded kernel module matches the new library",
    "unknown": "check `nvidia-smi`; forwarding continues and arbitration falls back to the engines' own reports",
}

_NOT_AVAILABLE = 2**64 - 1
_MISMATCH_TEXT = ("driver/library version mismatch", "nvml/rm version mismatch")


def _err(state: str, message: str) -> GpuReadError:
    return GpuReadError(state, message, _FIXES[state])


def _is(exc: BaseException, nvml: ModuleType | None, *names: str) -> bool:
    if nvml is None:
        return False
    for name in names:
        cls = getattr(nvml, name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def map_error(exc: BaseException, nvml: ModuleType | None) -> GpuReadError:
    """Turn a pynvml failure into a health state. NVMLError instances are unhashable: compare, never key."""
    if isinstance(exc, GpuReadError):
        return exc
    text = str(exc)
    if isinstance(exc, ImportError):
        return _err("library_missing", f"nvidia-ml-py (module pynvml) is not importable: {text}")
    if _is(exc, nvml, "NVMLLibraryMismatchError", "NVMLError_LibRmVersionMismatch") or \
            any(t in text.lower() for t in _MISMATCH_TEXT):
        return _err("driver_mismatch", f"NVML: Driver/library version mismatch ({text})")
    if _is(exc, nvml, "NVMLError_LibraryNotFound"):
        return _err("library_missing", f"NVML shared library not found ({text})")
    if _is(exc, nvml, "NVMLError_DriverNotLoaded"):
        return _err("driver_not_loaded", f"NVIDIA driver not loaded ({text})")
    if _is(exc, nvml, "NVMLError_NoPermission"):
        return _err("no_permission", f"no permission to query the GPU ({text})")
    if _is(exc, nvml, "NVMLError_GpuIsLost"):
        return _err("gpu_lost", f"the GPU is lost ({text})")
    return _err("unknown", f"NVML read failed: {type(exc).__name__}: {text}")


class _ProcessEntry(Protocol):
    """What the code reads of pynvml's process entries (usedGpuMemory is read with getattr: it may be
    missing or None)."""

    pid: int


def _kind(listed_as: set[str]) -> Literal["compute", "graphics", "both"]:
    if len(listed_as) == 2:
        return "both"
    return "compute" if "compute" in listed_as else "graphics"


@dataclass(frozen=True, slots=True)
class _Device:
    index: int
    handle: object
    name: str
    uuid: str


@dataclass(frozen=True, slots=True)
class ProcInfo:
    name: str
    cmdline: str
    start_time: float | None


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlReader:
    """`GpuReader` over NVML. `nvml` injects a pynvml-like module (tests); by default it is imported lazily.
    `index`: read that device only; None (the default): every device NVML counts."""

    def __init__(self, index: int | None = None, *, proc_root: Path = Path("/proc"), nvml: ModuleType | None = None,
                 clock: Clock | None = None, clk_tck: int | None = None, fd_links: FdLinks = read_fd_links) -> None:
        self.index = index
        self.proc_root = proc_root
        self._tree_reader = ProcTreeReader(proc_root, fd_links=fd_links)
        self._nvml = nvml
        self._clock = clock or SystemClock()
        self._clk_tck = clk_tck or os.sysconf("SC_CLK_TCK")
        self._handles: list[_Device] | None = None
        self._cuda_envs: dict[tuple[int, float | None], tuple[tuple[str, str], ...] | None] = {}
        self._mem_v2 = True  # flips to False once the driver says v2 is not supported

    # -- NVML ----------------------------------------------------------------------------------
    def _module(self) -> ModuleType:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def _ensure(self) -> tuple[ModuleType, list[_Device]]:
        nvml = self._module()
        if self._handles is None:
            nvml.nvmlInit()  # on failure _handles stays None: the next read retries
            count = getattr(nvml, "nvmlDeviceGetCount", None)
            if self.index is not None:
                indices = [self.index]
            else:  # no count (an old binding) or none counted: device 0, which raises NVML's own error if absent
                indices = list(range(int(count()))) if count is not None else []
            handles = []
            for index in indices or [0]:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                except Exception:
                    uuid = ""
                handles.append(_Device(index, handle, _text(nvml.nvmlDeviceGetName(handle)), uuid))
            self._handles = handles
        return nvml, self._handles

    def _reset(self) -> None:
        """After a failure, start over (nvmlInit again) on the next read."""
        if self._handles is not None and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._handles = None

    def _memory(self, nvml: ModuleType, handle: object) -> tuple[int, int, int, int]:
        if self._mem_v2 and hasattr(nvml, "nvmlMemory_v2"):
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                return int(m.total), int(m.reserved), int(m.used), int(m.free)
            except TypeError:
                pass  # an old pynvml without the version argument
            except Exception as exc:
                if not _is(exc, nvml, "NVMLError_NotSupported", "NVMLError_FunctionNotFound",
                           "NVMLError_ArgumentVersionMismatch"):
                    raise
            self._mem_v2 = False
        m = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(m.total), 0, int(m.used), int(m.free)

    def _running(self, nvml: ModuleType, handle: object, fn: str, notes: list[str]) -> list[_ProcessEntry]:
        try:
            return list(getattr(nvml, fn)(handle) or [])
        except Exception as exc:
            if _is(exc, nvml, "NVMLError_NotSupported"):
                kind = "compute" if "Compute" in fn else "graphics"
                notes.append(f"the driver does not list {kind} processes on this device (not supported)")
                return []
            raise

    # -- /proc ---------------------------------------------------------------------------------
    def proc_info(self, pid: int) -> ProcInfo:
        base = self.proc_root / str(pid)
        try:
            name = (base / "comm").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            name = ""
        try:
            raw = (base / "cmdline").read_bytes()
            cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            cmdline = ""
        return ProcInfo(name, cmdline, self._start_time(base))

    def _start_time(self, base: Path) -> float | None:
        try:
            stat = (base / "stat").read_text(encoding="utf-8", errors="replace")
            # comm (field 2) is in parentheses and may hold spaces or ')': split after the last one
            rest = stat.rpartition(")")[2].split()
            return int(rest[22 - 3]) / self._clk_tck  # rest[0] is field 3 (state)
        except (OSError, IndexError, ValueError):
            return None

    def _visible(self, pid: int) -> bool:
        try:
            return (self.proc_root / str(pid)).exists()
        except OSError:
            return False

    # -- the reader interface ------------------------------------------------------------------
    def read(self) -> GpuSnapshot:
        notes: list[str] = []
        devices: list[DeviceMemory] = []
        processes: list[GpuProcess] = []
        try:
            nvml, handles = self._ensure()
            for d in handles:
                total, reserved, used, free = self._memory(nvml, d.handle)
                compute = self._running(nvml, d.handle, "nvmlDeviceGetComputeRunningProcesses", notes)
                graphics = self._running(nvml, d.handle, "nvmlDeviceGetGraphicsRunningProcesses", notes)
                devices.append(DeviceMemory(index=d.index, name=d.name, total_bytes=total, reserved_bytes=reserved,
                                            used_bytes=used, free_bytes=free, uuid=d.uuid))
                processes.extend(self._merge(compute, graphics, d.index))
        except Exception as exc:
            self._reset()
            raise map_error(exc, self._nvml) from None  # self._nvml: set by the lazy import, None if it failed
        if processes and not any(self._visible(p.pid) for p in processes):
            notes.append(CONTAINER_NOTE)
        unique = tuple({p.pid: p for p in processes}.values())
        tree = self._tree(unique, notes)
        several = len(devices) > 1
        if several:
            processes = self._with_cuda_env(processes)
        return GpuSnapshot(device=devices[0], processes=tuple(processes), source="nvml", taken_at=self._clock.now(),
                           notes=tuple(dict.fromkeys(notes)), tree=tree, devices=tuple(devices) if several else ())

    def _with_cuda_env(self, processes: list[GpuProcess]) -> list[GpuProcess]:
        """Each process's CUDA device variables, read from its lineage's environ (proxy/gpu/devices.py).
        A process's environ is the one it started with: read once per process (pid and start time)."""
        cache: dict[int, tuple[tuple[str, str], ...] | None] = {}
        known: dict[tuple[int, float | None], tuple[tuple[str, str], ...] | None] = {}
        out = []
        for p in processes:
            key = p.identity
            if key in self._cuda_envs and p.start_time is not None:
                known[key] = self._cuda_envs[key]
            elif key not in known:
                known[key] = lineage_cuda_env(self.proc_root, p.pid, cache)
            out.append(replace(p, cuda_env=known[key]))
        self._cuda_envs = known  # only the processes on the cards now are remembered
        return out

    def _tree(self, processes: tuple[GpuProcess, ...], notes: list[str]) -> ProcessTree | None:
        """Who holds which listening socket; a failure here costs attribution by port, never the read."""
        try:
            return self._tree_reader.read(p.pid for p in processes)
        except Exception as exc:
            notes.append(f"process tree unreadable ({type(exc).__name__}: {exc}): "
                         "processes attributed by name and pattern only")
            return None

    def _merge(self, compute: list[_ProcessEntry], graphics: list[_ProcessEntry], device: int = 0) -> tuple[GpuProcess, ...]:
        used: dict[int, int | None] = {}
        kinds: dict[int, set[str]] = {}
        for listed_as, entries in (("compute", compute), ("graphics", graphics)):
            for e in entries:
                pid = int(e.pid)
                mem = getattr(e, "usedGpuMemory", None)
                # pynvml maps NVML_VALUE_NOT_AVAILABLE to None; guard the raw sentinel too
                mem = None if mem is None or int(mem) >= _NOT_AVAILABLE else int(mem)
                kinds.setdefault(pid, set()).add(listed_as)
                if pid not in used:
                    used[pid] = mem
                elif mem is not None:
                    # the same process listed twice reports the same allocation: take the larger, never add
                    prev = used[pid]
                    used[pid] = mem if prev is None else max(prev, mem)
        out = []
        for pid in sorted(used):
            info = self.proc_info(pid)
            out.append(GpuProcess(pid=pid, name=info.name, cmdline=info.cmdline, used_bytes=used[pid],
                                  start_time=info.start_time, kind=_kind(kinds[pid]), device=device))
        return tuple(out)
