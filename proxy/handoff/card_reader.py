"""Reading the card: one GPU read at a time, off the loop, each process attributed to its tenant and
placed on the card its tenant uses; a reader that fails falls back to what the engines say about
themselves, marked as an estimate (invariant 10). Every reading is posted to whoever plans on it
(the scheduler's `observe_card`), whoever asked for it.

    reader = CardReader(registry, NvmlReader(), clock, control, adapters, scheduler.observe_card)
    snap = await reader.read()          # posted to the scheduler too
    reader.last_read_error              # the GPU reader's own health, for /api/health
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.engines.ports import CardPorts
from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot, Attributor
from proxy.gpu.devices import DevicePlacer
from proxy.gpu.snapshot import DeviceFigure, DeviceMemory, GpuProcess, GpuReader, GpuReadError, GpuSnapshot


class CardReader:
    def __init__(self, registry: Registry, reader: GpuReader, clock: Clock, control: httpx.AsyncClient,
                 adapter: Callable[[Tenant], CardPorts], observe: Callable[[AttributedSnapshot], None]) -> None:
        self.registry = registry
        self.reader = reader  # the GPU reader (NVML, the simulator's); a test may swap it
        self.clock = clock
        self.control = control  # the engines' own reports are asked through it
        self.adapter = adapter
        self.observe = observe  # every reading is posted here
        self.attributor = Attributor(registry)
        self.placer = DevicePlacer(registry, lambda t: adapter(t).device_flag)  # which card each tenant uses
        self._lock = asyncio.Lock()  # one GPU read at a time
        self.last_read_error: GpuReadError | None = None  # the reader's own health, for /api/health
        self._measured_device: DeviceMemory | None = None  # the last device figures a reader measured

    async def read(self) -> AttributedSnapshot:
        """One GPU read at a time, off the loop, posted to `observe`. A broken reader falls back to the
        engines' own reports."""
        async with self._lock:
            try:
                snap = self.placer.place(self.attributor.attribute(await asyncio.to_thread(self.reader.read)))
                self.last_read_error = None
                self._measured_device = snap.snapshot.device
            except Exception as exc:  # a failing reader never stops traffic (invariant 10)
                self.last_read_error = exc if isinstance(exc, GpuReadError) else GpuReadError(
                    "unknown", f"GPU read failed: {exc!r}", "run `hyperswap check`")
                snap = await self._engine_estimate()
            self.observe(snap)
            return snap

    async def _engine_estimate(self) -> AttributedSnapshot:
        """What the engines say about themselves, marked as an estimate (invariant 10).

        ComfyUI's /system_stats carries device-wide total and free (cudaMemGetInfo); without it
        the last good reading's total is used, and with neither the total is unknown (0, marked
        unknown). Used and free are then unknown too: self-reports do not see other programs."""
        procs: list[AttributedProcess] = []
        device: DeviceMemory | None = None
        for i, tenant in enumerate(self.registry):
            if not tenant.upstream:
                continue
            adapter = self.adapter(tenant)
            held = await adapter.self_reported_bytes(self.control)
            if held is not None:
                proc = GpuProcess(pid=-(i + 1), name=f"[{tenant.name} self-report]", cmdline="", used_bytes=held)
                procs.append(AttributedProcess(proc, tenant.name))
            if device is None:
                device = await adapter.device_report(self.control)
        if device is None:
            # the card does not shrink when its reader breaks: the last measured total stays true
            prev = self._measured_device
            total = prev.total_bytes if prev else 0
            used = sum(p.process.used_bytes or 0 for p in procs)
            unknown: set[DeviceFigure] = {"used", "free", "reserved"}
            if not total:
                unknown.add("total")
            device = DeviceMemory(0, prev.name if prev else "unknown (GPU reader failed)", total, 0, used,
                                  max(0, total - used), unknown=frozenset(unknown))
        raw = GpuSnapshot(device, tuple(p.process for p in procs), source="engine-estimate", taken_at=self.clock.now(),
                          notes=("GPU reader failed: memory figures are the engines' own estimates",))
        return AttributedSnapshot(raw, tuple(procs))
