"""A simulated GPU read through the same interface as NVML.

Thread-safe: the proxy reads it from a worker thread while simulators running on the event loop
allocate and free. Simulators model *when* memory comes back (asynchronously, after the engine
already answered); this object only holds the current truth.

One card by default (the object itself is device 0); `add_device()` adds more, and `device(i)` is
a view of card i with the same methods, for a simulator that runs on that card.

Real processes hold simulated memory too (`watch(folder)`): an app the proxy starts as a child (the
speech relay, `proxy/sim/relay.py`) writes `<pid>.json` (`{"vram_bytes": N}`) into the folder once its
model is loaded; the card takes it if it fits (answering `<pid>.ok`) or refuses it like cudaMalloc
(`<pid>.oom`, `{"requested", "free"}`). A taken process is listed with its real name and command line
from /proc for exactly as long as it lives (a zombie no longer counts), as NVML shows a process's
memory; then its files are removed and its memory is free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
class _Real:
    """A real process holding simulated memory: its pid, the kernel's start time of it (so a reused
    pid is never taken for it) and its registration file."""
    proc: _Proc
    kernel_start: int
    file: Path


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live pid from /proc/<pid>/stat; None when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, kernel_start: int | None = None) -> bool:
    """Alive and not a zombie (a dead process waiting to be reaped holds no GPU memory); with
    `kernel_start`, still the same process."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and (kernel_start is None or stat[1] == kernel_start)


def _describe(pid: int) -> tuple[str, str]:
    """(name, command line) as NVML's users read them: /proc/<pid>/comm and /proc/<pid>/cmdline."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = "?"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        cmdline = ""
    return name, cmdline


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
        # every allocation the card could not grant (an engine's OOM, a load spilled to the CPU): a test
        # of the proxy's planning asserts it stays empty (the card never over-committed)
        self.shortfalls: list[str] = []
        self.fail_with: Exception | None = None  # set to make read() raise (health tests)
        self.card_settings = SimulatedCardSettings(name=name)  # power limit, clocks, fans: GET /api/gpu
        # The box's model files are 1/SCALE stand-ins: the size of the model each stands for, by path
        # (`ProxyView.model_file_size`), so sizes and load speeds are the model's, not the stand-in's.
        self.model_file_sizes: Callable[[str], int | None] | None = None
        # real processes that registered memory (`watch`), by pid; apart from the simulated ones, whose
        # made-up pids a real one may share (`_procs` is addressed by the simulators, this never is)
        self._real: dict[int, _Real] = {}
        self._folder: Path | None = None
        self._folder_device = 0
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        # suspended processes (release kind cuda_suspend, proxy/sim/checkpoint.py): pid -> the bytes the
        # driver parked in host RAM, and what their CUDA calls wait on until the restore (loop side only)
        self._parked: dict[int, int] = {}
        self._resumed: dict[int, asyncio.Event] = {}

    # -- real processes -------------------------------------------------------------------
    def watch(self, folder: Path, *, device: int = 0, poll_s: float = 0.005) -> None:
        """Take memory registrations of real processes from `folder` (see the module's docstring),
        on card `device`. A thread answers them within `poll_s` (the app waits for the answer), and
        every read of the card also looks, so a process that exited is never counted after."""
        if self._watcher is not None:
            raise RuntimeError("this simulated GPU already watches a folder")
        if not 0 <= device < self.device_count:
            raise ValueError(f"no simulated device {device}")
        folder.mkdir(parents=True, exist_ok=True)
        self._folder, self._folder_device = folder, device
        self._stop_watching.clear()

        def loop() -> None:
            while not self._stop_watching.wait(poll_s):
                with self._lock:
                    self._sync_locked()

        self._watcher = threading.Thread(target=loop, name="simulated-gpu-watch", daemon=True)
        self._watcher.start()

    def unwatch(self) -> None:
        """Stop taking registrations; processes taken stay counted while they live (read() still looks)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            self._stop_watching.set()
            watcher.join()

    def real_pids(self) -> list[int]:
        """The real processes holding memory now."""
        with self._lock:
            self._sync_locked()
            return sorted(self._real)

    def _sync_locked(self) -> None:
        """Drop real processes that ended; take (or refuse) new registrations."""
        for pid, real in list(self._real.items()):
            if not _alive(pid, real.kernel_start):
                del self._real[pid]
                for suffix in (".json", ".ok"):
                    with contextlib.suppress(OSError):
                        real.file.with_suffix(suffix).unlink()
        folder = self._folder
        if folder is None:
            return
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            stem, _, ext = name.partition(".")
            if ext != "json" or not stem.isdigit() or int(stem) in self._real:
                continue
            self._take_locked(int(stem), folder / name)

    def _take_locked(self, pid: int, file: Path) -> None:
        stat = _proc_stat(pid)
        try:
            nbytes = int(json.loads(file.read_text())["vram_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            nbytes = -1
        if stat is None or stat[0] in ("Z", "X") or nbytes < 0:  # gone before it was seen, or unreadable
            with contextlib.suppress(OSError):
                file.unlink()
            return
        device = self._folder_device
        free = self._free_locked(device)
        if nbytes > free:  # as cudaMalloc: the app is told, and holds nothing
            _write_atomic(file.with_suffix(".oom"), {"requested": nbytes, "free": free})
            with contextlib.suppress(OSError):
                file.unlink()
            return
        name, cmdline = _describe(pid)
        proc = _Proc(pid, name, cmdline, nbytes, time.time(), device=device)
        self._real[pid] = _Real(proc, stat[1], file)
        _write_atomic(file.with_suffix(".ok"), {"vram_bytes": nbytes})

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
            self._parked.pop(pid, None)  # the driver frees a process's parked memory with it
        gate = self._resumed.pop(pid, None)
        if gate is not None:
            gate.set()

    # -- suspended processes (CUDA checkpointing) -------------------------------------------
    def park(self, pid: int) -> int:
        """Suspend a process: its device memory leaves the card (into host RAM); returns the bytes.
        Its CUDA calls (`cuda_ready`) block until `unpark`. Called on the event loop."""
        with self._lock:
            proc = self._procs[pid]
            nbytes, proc.used = proc.used, 0
            self._parked[pid] = nbytes
        self._resumed.setdefault(pid, asyncio.Event()).clear()
        return nbytes

    def unpark(self, pid: int) -> None:
        """Restore a suspended process: its memory back on the card (SimulatedOutOfMemory when it no
        longer fits: the restore fails and the process stays suspended), its CUDA calls unblocked."""
        with self._lock:
            nbytes = self._parked[pid]
            free = self._free_locked(self._procs[pid].device)
            if nbytes > free:
                raise SimulatedOutOfMemory(nbytes, free)
            self._procs[pid].used += nbytes
            del self._parked[pid]
        gate = self._resumed.pop(pid, None)
        if gate is not None:
            gate.set()

    def parked(self) -> dict[int, int]:
        """pid -> bytes parked in host RAM, of every suspended process."""
        with self._lock:
            return dict(self._parked)

    async def cuda_ready(self, pid: int) -> None:
        """Return once the process is not suspended: a simulated engine awaits it before GPU work, as
        the driver blocks a suspended process's CUDA calls until its restore."""
        gate = self._resumed.get(pid)
        while gate is not None and not gate.is_set():
            await gate.wait()
            gate = self._resumed.get(pid)

    def alive(self, pid: int) -> bool:
        with self._lock:
            return pid in self._procs

    # -- memory ---------------------------------------------------------------------------
    def free_bytes(self, device: int = 0) -> int:
        with self._lock:
            self._sync_locked()
            return self._free_locked(device)

    def _free_locked(self, device: int = 0) -> int:
        card = self._card(device)
        return card.total_bytes - card.reserved_bytes - self._used_locked(device)

    def _used_locked(self, device: int) -> int:
        """What every process on the card holds, simulated and real."""
        return (sum(p.used for p in self._procs.values() if p.device == device)
                + sum(r.proc.used for r in self._real.values() if r.proc.device == device))

    def used_by(self, pid: int) -> int:
        with self._lock:
            p = self._procs.get(pid)
            return p.used if p else 0

    def allocate(self, pid: int, nbytes: int) -> None:
        """Grow a process by nbytes, or raise SimulatedOutOfMemory (like cudaMalloc)."""
        with self._lock:
            self._sync_locked()
            free = self._free_locked(self._procs[pid].device)
            if nbytes > free:
                self.shortfalls.append(f"pid {pid} asked {nbytes / 2**30:.2f} GiB with {free / 2**30:.2f} GiB free: "
                                       "out of memory")
                raise SimulatedOutOfMemory(nbytes, free)
            self._procs[pid].used += nbytes

    def allocate_up_to(self, pid: int, nbytes: int) -> int:
        """Grow a process by as much of nbytes as fits; returns what was taken (partial offload)."""
        with self._lock:
            self._sync_locked()
            take = max(0, min(nbytes, self._free_locked(self._procs[pid].device)))
            if take < nbytes:
                self.shortfalls.append(f"pid {pid} asked {nbytes / 2**30:.2f} GiB, got {take / 2**30:.2f} GiB: the rest "
                                       "on the CPU")
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
            self._sync_locked()
            devices = []
            for i in range(self.device_count):
                card = self._card(i)
                used = self._used_locked(i)
                devices.append(DeviceMemory(index=i, name=card.name, total_bytes=card.total_bytes,
                                            reserved_bytes=card.reserved_bytes, used_bytes=used + card.reserved_bytes,
                                            free_bytes=self._free_locked(i), uuid=f"GPU-simulated-{i}"))
            procs = tuple(GpuProcess(pid=p.pid, name=p.name, cmdline=p.cmdline,
                                     used_bytes=None if p.unknown_memory else p.used, start_time=p.start_time,
                                     device=p.device, cuda_env=p.cuda_env)
                          for p in sorted([*self._procs.values(), *(r.proc for r in self._real.values())],
                                          key=lambda p: p.pid))
        return GpuSnapshot(device=devices[0], processes=procs, source="simulated", taken_at=time.monotonic(),
                           devices=tuple(devices) if len(devices) > 1 else ())


def _write_atomic(path: Path, data: dict[str, int]) -> None:
    """Whole or not at all: the reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


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

    async def cuda_ready(self, pid: int) -> None:
        await self.gpu.cuda_ready(pid)

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
