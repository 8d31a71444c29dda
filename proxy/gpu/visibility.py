"""What the proxy can honestly say about the card, and what still works without a GPU reader.

Never claim what cannot be seen: a figure nobody measured is null (and no sample in /metrics),
never 0; a tenant whose memory nobody reported has an unknown holding, not an empty one. NVML is
what sees every process on the card. Without it (no driver, no library, a container without the
device) forwarding and in-flight tracking go on (invariant 10), plans run on the engines' own
reports when one of them reports the card's size and are skipped otherwise, and no release is
confirmed on the card. `capabilities()` says which, for /api/health and the line `hyperswap serve`
prints at start.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.encoding import JSONModel
from proxy.gpu.attribution import UNMANAGED, AttributedSnapshot
from proxy.gpu.snapshot import DeviceFigure, GpuReadError

CapabilityStatus = Literal["ok", "estimated", "off"]


class Card(JSONModel):
    index: int
    name: str
    uuid: str
    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None
    reserved_bytes: int | None
    tenants: dict[str, int] = Field(description="bytes each tenant (and `unmanaged`) holds on this card")
    placed: list[str] = Field(description="tenants pinned to or discovered on this card")

    @classmethod
    def all_of(cls, snap: AttributedSnapshot) -> list[Card]:
        """Each card with its figures and what each tenant (and `unmanaged`) holds on it."""
        out = []
        for d in snap.snapshot.all_devices:
            held: dict[str, int] = {}
            for p in snap.processes:
                if p.process.device == d.index and p.process.used_bytes:
                    held[p.tenant] = held.get(p.tenant, 0) + p.process.used_bytes
            out.append(cls(index=d.index, name=d.name, uuid=d.uuid, total_bytes=d.figure("total"),
                           free_bytes=d.figure("free"), used_bytes=d.figure("used"),
                           reserved_bytes=d.figure("reserved"), tenants=held,
                           placed=sorted(t for t, pl in snap.placement.items() if pl.devices and d.index in pl.devices)))
        return out


class Device(JSONModel):
    """Unknown is not zero: a figure nobody measured is null (without a GPU reader: used, free and
    reserved; the total too when no engine reports the card)."""
    name: str
    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None
    reserved_bytes: int | None
    source: str = Field(description="nvml, simulated, or engine-estimate")
    notes: list[str]
    devices: list[Card] | None = Field(default=None, description="only on a host with several GPUs: each card (the "
                                                                 "figures above are then the whole host's sums)")

    @classmethod
    def of(cls, snap: AttributedSnapshot) -> Device:
        """The device as the admin API and the event stream show it: unknown figures are null. On a
        host with several cards: the whole host's figures (the sums), and each card (`devices`, unset
        on one card: absent from the answer)."""
        raw = snap.snapshot
        if raw.several_devices:
            cards = raw.all_devices

            def total(name: DeviceFigure) -> int | None:
                figures = [d.figure(name) for d in cards]
                return None if any(f is None for f in figures) else sum(f or 0 for f in figures)
            return cls(name=f"{len(cards)} GPUs: " + ", ".join(f"{d.index}: {d.name}" for d in cards),
                       total_bytes=total("total"), free_bytes=total("free"), used_bytes=total("used"),
                       reserved_bytes=total("reserved"), source=raw.source, notes=list(raw.notes),
                       devices=Card.all_of(snap))
        dev = raw.device
        return cls(name=dev.name, total_bytes=dev.figure("total"), free_bytes=dev.figure("free"),
                   used_bytes=dev.figure("used"), reserved_bytes=dev.figure("reserved"),
                   source=raw.source, notes=list(raw.notes))


def held_by_device(snap: AttributedSnapshot, tenant: str) -> dict[int, int]:
    """Card index -> bytes the tenant's processes hold there (known amounts only)."""
    out: dict[int, int] = {}
    for p in snap.processes:
        if p.tenant == tenant and p.process.used_bytes is not None:
            out[p.process.device] = out.get(p.process.device, 0) + p.process.used_bytes
    return out


class CardHolding(JSONModel):
    index: int
    name: str
    vram_bytes: int


class TenantDevices(JSONModel):
    """Only on a host with several GPUs: the cards the tenant's engine loads on, and why."""
    devices: list[int] | None = Field(description="NVML indices; null: any device")
    source: Literal["pinned", "discovered", "any"] = Field(
        description="pinned: `devices` in tenants.json; discovered: its process's --cuda-device or CUDA_VISIBLE_DEVICES")
    detail: str
    vram_by_device: list[CardHolding]

    @classmethod
    def of(cls, snap: AttributedSnapshot, tenant: str) -> TenantDevices | None:
        """A tenant's cards for its view: where it may load (pinned, discovered or any, and why) and
        what it holds on each. None on a one-card host, whose views stay as they were."""
        if not snap.snapshot.several_devices:
            return None
        placement = snap.placement.get(tenant)
        held = held_by_device(snap, tenant)
        return cls(devices=None if placement is None or placement.devices is None else list(placement.devices),
                   source="any" if placement is None else placement.source,
                   detail="not placed yet: may use any device" if placement is None else placement.detail,
                   vram_by_device=[CardHolding(index=d.index, name=d.name, vram_bytes=held.get(d.index, 0))
                                   for d in snap.snapshot.all_devices])


def sees(snap: AttributedSnapshot, tenant: str) -> bool:
    """Whether the snapshot knows what this tenant holds. From the engines' own reports only the
    tenants that answered are known; a VRAM-only tenant (the desktop) or a silent engine is not."""
    if not snap.estimated:
        return True
    return tenant != UNMANAGED and any(p.tenant == tenant for p in snap.processes)


def tenant_vram(snap: AttributedSnapshot, tenant: str) -> int | None:
    """What a tenant holds, or None when nobody could see it."""
    return snap.held_by(tenant) if sees(snap, tenant) else None


def unmanaged_vram(snap: AttributedSnapshot) -> int | None:
    """What processes outside every tenant hold; None without a GPU reader (they are invisible)."""
    return None if snap.estimated else snap.held_by(UNMANAGED)


class Capability(JSONModel):
    name: Literal["forwarding", "in-flight tracking", "arbitration", "confirmed releases"]
    status: CapabilityStatus = Field(description="estimated: on the engines' own reports")
    detail: str


def capabilities(snap: AttributedSnapshot | None, error: GpuReadError | None) -> list[Capability]:
    """What works now, from the last snapshot and the reader's last error."""
    out = [Capability(name="forwarding", status="ok", detail="every listener forwards requests and websockets unchanged"),
           Capability(name="in-flight tracking", status="ok", detail="busy state comes from the traffic through the proxy")]
    if error is None and snap is not None and not snap.estimated:
        return [*out,
                Capability(name="arbitration", status="ok", detail=f"plans from the card's own figures ({snap.snapshot.source})"),
                Capability(name="confirmed releases", status="ok",
                           detail="a release is done when the card shows the memory back")]
    if snap is not None and snap.snapshot.device.size_known:
        arbitration = Capability(
            name="arbitration", status="estimated",
            detail="plans use the engines' own reports (ComfyUI's device figures, Ollama's /api/ps); memory held by "
            "other programs is invisible, so a load may still run out of memory")
    else:
        arbitration = Capability(
            name="arbitration", status="off",
            detail="the card's size is unknown (no engine reports the device): GPU requests are forwarded without a plan, "
            "nothing is released for them and nothing is refused")
    return [*out, arbitration, Capability(
        name="confirmed releases", status="off",
        detail="the card cannot be read: a release ends when the engine's own report says its memory is gone, marked estimated")]


def summary(caps: list[Capability]) -> str:
    """`works: forwarding, ...; estimated: ...; does not work: ...` in one line."""
    groups = {"ok": "works", "estimated": "estimated", "off": "does not work"}
    parts = []
    for status, label in groups.items():
        names = [c.name if status == "ok" else f"{c.name} ({c.detail})" for c in caps if c.status == status]
        if names:
            parts.append(f"{label}: {', '.join(names)}")
    return "; ".join(parts)


def start_notice(snap: AttributedSnapshot | None, error: GpuReadError | None) -> str | None:
    """The one line `hyperswap serve` prints on stderr when it starts without a GPU reader."""
    if error is None:
        return None
    return (f"hyperswap: no GPU reader ({error.state}: {error.message}); "
            f"{summary(capabilities(snap, error))}; fix: {error.fix}")
