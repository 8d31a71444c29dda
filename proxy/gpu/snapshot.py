"""What the GPU holds: the snapshot types and the reader interface.

Every reader (NVML on a real card, the simulated GPU in `proxy.sim.gpu`, the engines' own reports
when NVML is broken) produces the same `GpuSnapshot`, so nothing downstream can tell them apart.
Readers are blocking (C calls, /proc reads): callers run `read()` off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal, Protocol

from proxy.encoding import JSONModel

SnapshotSource = Literal["nvml", "simulated", "engine-estimate"]
DeviceFigure = Literal["total", "reserved", "used", "free"]


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod a process runs in, as the dashboard and the API show it, and what tenants match on."""

    namespace: str
    name: str
    container: str | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)



class PodName(JSONModel):
    """A process's pod as the API shows it (`PodRef` without the labels it is matched on)."""

    namespace: str
    name: str
    container: str | None

    @classmethod
    def of(cls, pod: PodRef) -> PodName:
        return cls(namespace=pod.namespace, name=pod.name, container=pod.container)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    name: str
    cmdline: str
    used_bytes: int | None  # None: the driver cannot tell (WSL, some MIG setups); unknown is not zero
    start_time: float | None = None  # from /proc/<pid>/stat; with pid it identifies the process across PID reuse
    kind: Literal["compute", "graphics", "both"] = "compute"
    device: int = 0  # the NVML index of the device this entry's memory is on (a process on two cards: two entries)
    # CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER from /proc/<pid>/environ, as read (absent keys: unset);
    # None: not read or unreadable (another user's process, the simulator)
    cuda_env: tuple[tuple[str, str], ...] | None = None

    @property
    def identity(self) -> tuple[int, float | None]:
        return (self.pid, self.start_time)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    index: int
    name: str
    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    free_bytes: int
    uuid: str = ""
    # Figures nobody measured (the engines' reports do not cover them): shown as null, never as 0.
    # The planner still gets an int here; `size_known` says whether it may plan with them at all.
    unknown: frozenset[DeviceFigure] = frozenset()

    def figure(self, name: DeviceFigure) -> int | None:
        """A figure as the admin API shows it: None when it was not measured."""
        return None if name in self.unknown else int(getattr(self, f"{name}_bytes"))

    @property
    def size_known(self) -> bool:
        """The card's size is known: without it no plan can be made (requests go unplanned)."""
        return "total" not in self.unknown and self.total_bytes > 0


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening TCP socket of this machine's network namespace (/proc/net/tcp, tcp6: state 0A)."""

    inode: int
    address: str  # "127.0.0.1", "0.0.0.0", "::", "::1"; IPv4-mapped IPv6 shown as IPv4
    port: int
    uid: int  # the socket's owner uid: whose processes can hold it, barring handed-over sockets


@dataclass(frozen=True, slots=True)
class ProcNode:
    """One process of the tree: a GPU process or one of its ancestors."""

    pid: int
    ppid: int
    name: str  # comm
    uid: int | None  # effective uid, read only when `sockets` is None; None: not read or unknown
    sockets: frozenset[int] | None  # inodes of the Listeners it holds; None: /proc/<pid>/fd unreadable


@dataclass(frozen=True, slots=True)
class ProcessTree:
    """The GPU processes, their ancestors and the listening sockets they hold, read once per snapshot.

    Only readers that see this machine's /proc fill it in (NVML); the simulated GPU and the engines'
    own estimates leave `GpuSnapshot.tree` None, and attribution then goes by match rules alone."""

    listeners: tuple[Listener, ...] = ()
    nodes: Mapping[int, ProcNode] = field(default_factory=dict, hash=False)  # pid -> node; never mutated

    def lineage(self, pid: int, max_depth: int = 64) -> Iterator[ProcNode]:
        """The process itself, then its parent, up to (not including) init; stops at a loop or a gap."""
        seen: set[int] = set()
        node = self.nodes.get(pid)
        while node is not None and node.pid > 1 and node.pid not in seen and len(seen) < max_depth:
            seen.add(node.pid)
            yield node
            node = self.nodes.get(node.ppid)


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    device: DeviceMemory
    processes: tuple[GpuProcess, ...] = ()
    source: SnapshotSource = "nvml"
    taken_at: float = 0.0  # clock.now() when read
    notes: tuple[str, ...] = field(default_factory=tuple)  # e.g. "pids not visible in /proc (container)"
    tree: ProcessTree | None = None  # None: the reader cannot see the processes' /proc (simulated, estimates)
    pods: Mapping[int, PodRef] = field(default_factory=dict, hash=False)  # pid -> its Kubernetes pod (proxy.gpu.pods)
    # Every device the reader saw, by NVML index, when there are several; `device` is then the first
    # and `processes` holds every device's entries (each with its `device`). Empty: one device only.
    devices: tuple[DeviceMemory, ...] = ()

    @property
    def all_devices(self) -> tuple[DeviceMemory, ...]:
        return self.devices or (self.device,)

    @property
    def several_devices(self) -> bool:
        return len(self.devices) > 1

    def on_device(self, index: int) -> GpuSnapshot:
        """This snapshot as if the card `index` were the only one: its figures and its processes."""
        if not self.several_devices:
            return self
        device = next((d for d in self.devices if d.index == index), None)
        if device is None:
            raise KeyError(f"no device {index} in this snapshot")
        return replace(self, device=device, processes=tuple(p for p in self.processes if p.device == index),
                       devices=())

    @property
    def estimated(self) -> bool:
        return self.source == "engine-estimate"

    @property
    def free_bytes(self) -> int:
        return self.device.free_bytes

    def process(self, pid: int) -> GpuProcess | None:
        return next((p for p in self.processes if p.pid == pid), None)


class GpuReader(Protocol):
    """Reads the devices it was given (one, or every device of the host). Blocking; may raise `GpuReadError`."""

    def read(self) -> GpuSnapshot: ...


class GpuReadError(Exception):
    """The reader could not read the GPU. `state` is one of the health states below."""

    def __init__(self, state: str, message: str, fix: str) -> None:
        super().__init__(message)
        self.state = state  # library_missing | driver_not_loaded | no_permission | gpu_lost | driver_mismatch | unknown
        self.message = message
        self.fix = fix


class GpuError(JSONModel):
    """A `GpuReadError` as the API shows it (the stats, /api/gpu)."""

    state: str
    error: str
    fix: str

    @classmethod
    def of(cls, err: GpuReadError) -> GpuError:
        return cls(state=err.state, error=err.message, fix=err.fix)
