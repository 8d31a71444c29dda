"""A simulated GPU read through the same interface as NVML.

Thread-safe: the proxy reads it from a worker thread while simulators running on the event loop
allocate and free. Simulators model *when* memory comes back (asynchronously, after the engine
already answered); this object only holds the current truth.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot
from proxy.sim.gpu_settings import SimulatedCardSettings

GIB = 2**30


class SimulatedOutOfMemory(Exception):
    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} bytes with {free} free")
        self.requested = requested
        self.free = free


@dataclass(slots=True)
class _Proc:
    pid: int
    name: str
    cmdline: str
    used: int
    start_time: float
    unknown_memory: bool = False


class SimulatedGpu:
    def __init__(self, total_bytes: int = 24 * GIB, reserved_bytes: int = 300 * 2**20,
                 name: str = "Simulated RTX 4090", first_pid: int = 4000) -> None:
        self.total_bytes = total_bytes
        self.reserved_bytes = reserved_bytes
        self.name = name
        self._procs: dict[int, _Proc] = {}
        self._pids = itertools.count(first_pid)
        self._lock = threading.Lock()
        self.reads = 0
        self.fail_with: Exception | None = None  # set to make read() raise (health tests)
        self.card_settings = SimulatedCardSettings(name=name)  # power limit, clocks, fans: GET /api/gpu

    # -- processes ------------------------------------------------------------------------
    def spawn(self, name: str, cmdline: str, used_bytes: int = 0, *, pid: int | None = None,
              unknown_memory: bool = False) -> int:
        with self._lock:
            pid = next(self._pids) if pid is None else pid
            self._procs[pid] = _Proc(pid, name, cmdline, 0, time.time() + pid * 1e-6, unknown_memory)
        if used_bytes:
            self.allocate(pid, used_bytes)
        return pid

    def kill(self, pid: int) -> None:
        with self._lock:
            self._procs.pop(pid, None)

    def alive(self, pid: int) -> bool:
        with self._lock:
            return pid in self._procs

    # -- memory ---------------------------------------------------------------------------
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_locked()

    def _free_locked(self) -> int:
        return self.total_bytes - self.reserved_bytes - sum(p.used for p in self._procs.values())

    def used_by(self, pid: int) -> int:
        with self._lock:
            p = self._procs.get(pid)
            return p.used if p else 0

    def allocate(self, pid: int, nbytes: int) -> None:
        """Grow a process by nbytes, or raise SimulatedOutOfMemory (like cudaMalloc)."""
        with self._lock:
            free = self._free_locked()
            if nbytes > free:
                raise SimulatedOutOfMemory(nbytes, free)
            self._procs[pid].used += nbytes

    def allocate_up_to(self, pid: int, nbytes: int) -> int:
        """Grow a process by as much of nbytes as fits; returns what was taken (partial offload)."""
        with self._lock:
            take = max(0, min(nbytes, self._free_locked()))
            self._procs[pid].used += take
            return take

    def release(self, pid: int, nbytes: int | None = None) -> None:
        """Shrink a process by nbytes (None: to zero)."""
        with self._lock:
            p = self._procs.get(pid)
            if p is not None:
                p.used = 0 if nbytes is None else max(0, p.used - nbytes)

    def set_used(self, pid: int, nbytes: int) -> None:
        with self._lock:
            self._procs[pid].used = nbytes

    # -- the reader interface ---------------------------------------------------------------
    def read(self) -> GpuSnapshot:
        with self._lock:
            self.reads += 1
            if self.fail_with is not None:
                raise self.fail_with
            used = sum(p.used for p in self._procs.values())
            device = DeviceMemory(index=0, name=self.name, total_bytes=self.total_bytes,
                                  reserved_bytes=self.reserved_bytes, used_bytes=used + self.reserved_bytes,
                                  free_bytes=self._free_locked(), uuid="GPU-simulated-0")
            procs = tuple(GpuProcess(pid=p.pid, name=p.name, cmdline=p.cmdline,
                                     used_bytes=None if p.unknown_memory else p.used, start_time=p.start_time)
                          for p in sorted(self._procs.values(), key=lambda p: p.pid))
        return GpuSnapshot(device=device, processes=procs, source="simulated", taken_at=time.monotonic())
