"""A simulated GPU read through the same interface as NVML.

Thread-safe: the proxy reads it from a worker thread while simulators running on the event loop
allocate and free. Simulators model *when* memory comes back (asynchronously, after the engine
already answered); this object only holds the current truth.

One card by default (the object itself is device 0); `add_device()` adds more, and `device(i)` is
a view of card i with the same methods, for a simulator that runs on that card.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
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
    device: int = 0
    cuda_env: tuple[tuple[str, str], ...] | None = None  # what /proc/<pid>/environ would say


@dataclass(slots=True)
class _Card:
    name: str
    total_bytes: int
    reserved_bytes: int


class SimulatedGpu:
    simulated = True  # what the proxy's admin side asks (`ProxyView.simulated_gpu`) instead of importing this
    def __init__(self, total_bytes: int = 24 * GIB, reserved_bytes: int = 300 * 2**20,
                 name: str = "Simulated RTX 4090", first_pid: int = 4000) -> None:
        self.total_bytes = total_bytes
        self.reserved_bytes = reserved_bytes
        self.name = name
        self._procs: dict[int, _Proc] = {}
        self._pids = itertools.count(first_pid)
        self._lock = threading.Lock()
        self._more: list[_Card] = []  # devices 1, 2, ...; device 0 is this object's own figures
        self.reads = 0
        self.fail_with: Exception | None = None  # set to make read() raise (health tests)
        self.card_settings = SimulatedCardSettings(name=name)  # power limit, clocks, fans: GET /api/gpu
        # The box's model files are 1/SCALE stand-ins: the size of the model each stands for, by path
        # (`ProxyView.model_file_size`), so sizes and load speeds are the model's, not the stand-in's.
        self.model_file_sizes: Callable[[str], int | None] | None = None

    # -- processes ------------------------------------------------------------------------
    def add_device(self, total_bytes: int, reserved_bytes: int = 300 * 2**20, name: str = "Simulated RTX 4090") -> int:
        """Another card; returns its index."""
        with self._lock:
            self._more.append(_Card(name, total_bytes, reserved_bytes))
            return len(self._more)

    @property
    def device_count(self) -> int:
        return 1 + len(self._more)

    def device(self, index: int, cuda_env: tuple[tuple[str, str], ...] | None = None) -> SimulatedDevice:
        """Card `index`; what is spawned through it gets `cuda_env` (its simulated environment)."""
        if not 0 <= index < self.device_count:
            raise ValueError(f"no simulated device {index} ({self.device_count} in all)")
        return SimulatedDevice(self, index, cuda_env)

    def _card(self, index: int) -> _Card:
        return _Card(self.name, self.total_bytes, self.reserved_bytes) if index == 0 else self._more[index - 1]

    def spawn(self, name: str, cmdline: str, used_bytes: int = 0, *, pid: int | None = None,
              unknown_memory: bool = False, device: int = 0,
              cuda_env: tuple[tuple[str, str], ...] | None = None) -> int:
        with self._lock:
            pid = next(self._pids) if pid is None else pid
            self._procs[pid] = _Proc(pid, name, cmdline, 0, time.time() + pid * 1e-6, unknown_memory, device, cuda_env)
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
    def free_bytes(self, device: int = 0) -> int:
        with self._lock:
            return self._free_locked(device)

    def _free_locked(self, device: int = 0) -> int:
        card = self._card(device)
        return card.total_bytes - card.reserved_bytes - sum(p.used for p in self._procs.values() if p.device == device)

    def used_by(self, pid: int) -> int:
        with self._lock:
            p = self._procs.get(pid)
            return p.used if p else 0

    def allocate(self, pid: int, nbytes: int) -> None:
        """Grow a process by nbytes, or raise SimulatedOutOfMemory (like cudaMalloc)."""
        with self._lock:
            free = self._free_locked(self._procs[pid].device)
            if nbytes > free:
                raise SimulatedOutOfMemory(nbytes, free)
            self._procs[pid].used += nbytes

    def allocate_up_to(self, pid: int, nbytes: int) -> int:
        """Grow a process by as much of nbytes as fits; returns what was taken (partial offload)."""
        with self._lock:
            take = max(0, min(nbytes, self._free_locked(self._procs[pid].device)))
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
            devices = []
            for i in range(self.device_count):
                card = self._card(i)
                used = sum(p.used for p in self._procs.values() if p.device == i)
                devices.append(DeviceMemory(index=i, name=card.name, total_bytes=card.total_bytes,
                                            reserved_bytes=card.reserved_bytes, used_bytes=used + card.reserved_bytes,
                                            free_bytes=self._free_locked(i), uuid=f"GPU-simulated-{i}"))
            procs = tuple(GpuProcess(pid=p.pid, name=p.name, cmdline=p.cmdline,
                                     used_bytes=None if p.unknown_memory else p.used, start_time=p.start_time,
                                     device=p.device, cuda_env=p.cuda_env)
                          for p in sorted(self._procs.values(), key=lambda p: p.pid))
        return GpuSnapshot(device=devices[0], processes=procs, source="simulated", taken_at=time.monotonic(),
                           devices=tuple(devices) if len(devices) > 1 else ())


class SimulatedDevice:
    """One card of a `SimulatedGpu`, with the methods a simulator calls: what it spawns runs on this
    card and what it asks about free memory is this card's."""

    def __init__(self, gpu: SimulatedGpu, index: int, cuda_env: tuple[tuple[str, str], ...] | None = None) -> None:
        self.gpu = gpu
        self.index = index
        self.cuda_env = cuda_env

    @property
    def name(self) -> str:
        return self.gpu._card(self.index).name

    @property
    def total_bytes(self) -> int:
        return self.gpu._card(self.index).total_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.gpu._card(self.index).reserved_bytes

    def spawn(self, name: str, cmdline: str, used_bytes: int = 0, *, pid: int | None = None,
              unknown_memory: bool = False, cuda_env: tuple[tuple[str, str], ...] | None = None) -> int:
        return self.gpu.spawn(name, cmdline, used_bytes, pid=pid, unknown_memory=unknown_memory, device=self.index,
                              cuda_env=cuda_env if cuda_env is not None else self.cuda_env)

    def free_bytes(self) -> int:
        return self.gpu.free_bytes(self.index)

    def kill(self, pid: int) -> None:
        self.gpu.kill(pid)

    def alive(self, pid: int) -> bool:
        return self.gpu.alive(pid)

    def used_by(self, pid: int) -> int:
        return self.gpu.used_by(pid)

    def allocate(self, pid: int, nbytes: int) -> None:
        self.gpu.allocate(pid, nbytes)

    def allocate_up_to(self, pid: int, nbytes: int) -> int:
        return self.gpu.allocate_up_to(pid, nbytes)

    def release(self, pid: int, nbytes: int | None = None) -> None:
        self.gpu.release(pid, nbytes)

    def set_used(self, pid: int, nbytes: int) -> None:
        self.gpu.set_used(pid, nbytes)


SimulatedCard = SimulatedGpu | SimulatedDevice  # what a simulator runs on: the whole GPU or one of its cards
