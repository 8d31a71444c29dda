"""The one door: what the request side of the proxy (the GPU gate) may ask of the scheduler.

Every GPU request becomes work through these calls and no other (design invariant 14): tried at
once when its load is on the card and its peak fits, else queued (`GpuBroker.admit`, which
estimates the need first); an unload made work without a plan; the promise an admitted request
holds ended when its answer (or its job) ends. The scheduler (`scheduler.py`) is the one object
that implements it; the gate holds it as this protocol, so nothing on the request side can reach
the scheduler's state.
"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.config.schema import Tenant
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.inflight import Token
from proxy.handoff.tickets import Admitted, Handoff


class Door(Protocol):
    @property
    def card(self) -> AttributedSnapshot | None:
        """The latest card reading, whoever read it (None before the first)."""
        ...

    def admit_at_once(self, tenant: Tenant, key: str, need_bytes: int, work: Token | None = None) -> Admitted | None:
        """A load on the card whose peak fits now: admitted (its `work` made the tenant's work); None:
        it is queued instead."""
        ...

    def admit_unplanned(self, work: Token, tenant: str, key: str) -> None:
        """A request that loads nothing (an unload): the tenant's work at once."""
        ...

    def loaded(self, tenant: str, key: str) -> None:
        """The engine answered an admitted request for this load: it is on the card now."""
        ...

    def settle(self, handoff: Handoff | None) -> None:
        """The admitted request reached the engine (or gave up): its promise ends."""
        ...

    def settle_when_idle(self, handoff: Handoff | None) -> None:
        """A job outlives its answer: its promise lasts until its tenant has no work."""
        ...

    def wait_of(self, work: Token) -> dict[str, Any] | None:
        """While the request with this token waits: why, for whom (for its progress lines)."""
        ...

    def kick(self) -> None:
        """Something that can change a plan happened (a job ended, was lost)."""
        ...
