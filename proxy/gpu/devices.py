"""Which GPUs a tenant's engine uses, on a host with several.

Evidence, strongest first:

1. **Pinned**: `devices` in tenants.json, NVML indices (`[0]`) or UUIDs (`["GPU-8f2c..."]`).
2. **Discovered** from one of the tenant's GPU processes: the engine's own
   device flag on its command line (ComfyUI's `--cuda-device N`, named by the engine adapter's
   `device_flag`; ComfyUI turns it into CUDA_VISIBLE_DEVICES for itself, so it wins over the
   environment), else `CUDA_VISIBLE_DEVICES` from `/proc/<pid>/environ` (Ollama's runners inherit
   it from `ollama serve`). Read by the GPU reader's thread where /proc is readable (own processes,
   or root); kept after the process is gone, so an engine that released everything keeps its card.
3. **Any**: nothing says: the engine may use any device, and plans try each (the view says so).

CUDA numbers devices fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`; NVML numbers them by PCI
bus. A discovered index is taken as an NVML index, which is exact under PCI_BUS_ID or on identical
cards; otherwise the placement says so (a UUID is always exact).

Pure functions, plus `DevicePlacer`, which only remembers what was discovered.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.gpu.placement import Placement
from proxy.gpu.snapshot import DeviceMemory, GpuProcess

if TYPE_CHECKING:
    from proxy.gpu.attribution import AttributedSnapshot

CUDA_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_INDEX = re.compile(r"\d+")
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")


# -- reading /proc (blocking: the reader's thread) ------------------------------------------------

def read_cuda_env(proc_root: Path, pid: int) -> tuple[tuple[str, str], ...] | None:
    """The CUDA device variables a process started with; None when its environ is unreadable."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    return parse_environ(raw)


def _parent(proc_root: Path, pid: int) -> int | None:
    try:
        stat = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
        return int(stat.rpartition(")")[2].split()[1])  # field 4, after comm (which may hold ')')
    except (OSError, IndexError, ValueError):
        return None


def lineage_cuda_env(proc_root: Path, pid: int, cache: dict[int, tuple[tuple[str, str], ...] | None] | None = None,
                     max_depth: int = 64) -> tuple[tuple[str, str], ...] | None:
    """A process's CUDA device variables, the outermost CUDA_VISIBLE_DEVICES of its lineage (up to,
    not including, init) winning: what a server started with bounds every runner it starts (Ollama
    narrows each runner's own variable to the card it chose for that one model)."""
    memo = {} if cache is None else cache

    def env(p: int) -> tuple[tuple[str, str], ...] | None:
        if p not in memo:
            memo[p] = read_cuda_env(proc_root, p)
        return memo[p]

    chosen = env(pid)
    seen = {pid}
    parent = _parent(proc_root, pid)
    while parent is not None and parent > 1 and parent not in seen and len(seen) < max_depth:
        seen.add(parent)
        outer = env(parent)
        if outer is not None and any(k == "CUDA_VISIBLE_DEVICES" for k, _ in outer):
            chosen = outer
        parent = _parent(proc_root, parent)
    return chosen


def parse_environ(raw: bytes) -> tuple[tuple[str, str], ...]:
    out = []
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        name = key.decode("utf-8", "replace")
        if sep and name in CUDA_KEYS:
            out.append((name, value.decode("utf-8", "replace")))
    return tuple(out)


# -- parsing ---------------------------------------------------------------------------------------

def parse_visible_devices(value: str) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated indices or UUIDs, up to the first
    entry it cannot parse (CUDA ignores it and everything after); "" or "-1": no device at all."""
    out: list[str] = []
    for part in value.split(","):
        item = part.strip()
        if _INDEX.fullmatch(item) or _UUID.fullmatch(item):
            out.append(item)
        else:
            break
    return tuple(out)


def flag_value(cmdline: str, flag: str) -> str | None:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`); the last one wins, as argparse does."""
    try:
        argv = shlex.split(cmdline)
    except ValueError:
        argv = cmdline.split()
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


def resolve(specs: Sequence[int | str], devices: Sequence[DeviceMemory]) -> tuple[tuple[int, ...], list[str]]:
    """Indices or UUIDs (a UUID may be a unique prefix, as CUDA allows) -> NVML indices of present
    devices, and what could not be resolved."""
    found: list[int] = []
    missing: list[str] = []
    for spec in specs:
        text = str(spec)
        if isinstance(spec, int) or _INDEX.fullmatch(text):
            match = [d for d in devices if d.index == int(text)]
        else:
            match = [d for d in devices if d.uuid and d.uuid.lower().startswith(text.lower())]
        if len(match) == 1:
            if match[0].index not in found:
                found.append(match[0].index)
        else:
            missing.append(text if not match else f"{text} (matches {len(match)} devices)")
    return tuple(found), missing


def _names(devices: Sequence[DeviceMemory], indices: Sequence[int]) -> str:
    by = {d.index: d for d in devices}
    return ", ".join(f"GPU {i} ({by[i].name})" if i in by and by[i].name else f"GPU {i}" for i in indices)


# -- deciding --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Evidence:
    """What a tenant's processes say about their devices, and which process said it."""

    pid: int
    specs: tuple[str, ...]
    how: str  # "--cuda-device 1", "CUDA_VISIBLE_DEVICES=0"
    pci_order: bool  # CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA and NVML indices agree


def evidence_from(process: GpuProcess, device_flag: str | None) -> Evidence | None:
    env = dict(process.cuda_env or ())
    pci = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    if device_flag:
        value = flag_value(process.cmdline, device_flag)
        if value is not None:
            return Evidence(process.pid, parse_visible_devices(value), f"{device_flag} {value}", pci)
    if "CUDA_VISIBLE_DEVICES" in env:
        value = env["CUDA_VISIBLE_DEVICES"]
        return Evidence(process.pid, parse_visible_devices(value), f"CUDA_VISIBLE_DEVICES={value}", pci)
    return None


def place(tenant: Tenant, devices: Sequence[DeviceMemory], evidence: Evidence | None) -> Placement:
    """One tenant's placement from its pin, else the evidence, else any device."""
    if tenant.devices:
        found, missing = resolve(tenant.devices, devices)
        if found and not missing:
            return Placement(tenant.name, found, "pinned", f"pinned in tenants.json to {_names(devices, found)}")
        if found:
            return Placement(tenant.name, found, "pinned", f"pinned to {_names(devices, found)}; not on this host: "
                             f"{', '.join(missing)} (tenants.{tenant.name}.devices)")
        return Placement(tenant.name, None, "any", f"pinned to {', '.join(missing)} in tenants.json, but no such "
                         f"device is on this host ({len(devices)} found): may use any device until "
                         f"tenants.{tenant.name}.devices names one that exists")
    if evidence is not None:
        found, missing = resolve(evidence.specs, devices)
        if found:
            where = f"discovered from pid {evidence.pid} ({evidence.how}): {_names(devices, found)}"
            if not evidence.pci_order and any(not s.startswith(("GPU-", "MIG-")) for s in evidence.specs) \
                    and len({d.name for d in devices}) > 1:
                where += ("; CUDA numbers cards fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so on mixed "
                          "cards the index may name another card: pin the UUID in tenants.json to be sure")
            return Placement(tenant.name, found, "discovered", where)
        return Placement(tenant.name, None, "any", f"pid {evidence.pid} has {evidence.how}, which names no device "
                         "NVML lists: may use any device")
    return Placement(tenant.name, None, "any", "no devices in tenants.json and none discovered "
                     "(no --cuda-device, no readable CUDA_VISIBLE_DEVICES): may use any device")


AttributedLike = Sequence[tuple[GpuProcess, str]]  # (process, tenant)


class DevicePlacer:
    """Placements per snapshot; remembers discoveries, so an engine that let go of every process
    on the card (an idle Ollama) keeps its card. `device_flag` asks the engine adapter."""

    def __init__(self, registry: Registry, device_flag: Callable[[Tenant], str | None]) -> None:
        self.registry = registry
        self._device_flag = device_flag
        self._found: dict[str, Evidence] = {}

    def place(self, snap: AttributedSnapshot) -> AttributedSnapshot:
        """The snapshot with every tenant's placement; on one card it is returned as it is."""
        if not snap.snapshot.several_devices:
            return snap
        return replace(snap, placement=self.placements(snap.snapshot.all_devices,
                                                        [(p.process, p.tenant) for p in snap.processes]))

    def placements(self, devices: Sequence[DeviceMemory], processes: AttributedLike) -> dict[str, Placement]:
        """`processes`: the snapshot's (process, tenant) pairs. A runner's environment is inherited
        from the server that started it, so the GPU processes' own readings are enough."""
        for tenant in self.registry:
            flag = self._device_flag(tenant)
            for proc in (p for p, t in processes if t == tenant.name):
                ev = evidence_from(proc, flag)
                if ev is not None:
                    self._found[tenant.name] = ev
                    break
        return {t.name: place(t, devices, self._found.get(t.name)) for t in self.registry}

