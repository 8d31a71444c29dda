"""What the proxy outside a request (the watchdog on its timer, the admin API) tells the scheduler and
asks of it: a port of the scheduler, as `door.py` is the request side's and `effects.py` what the
scheduler does to the world (llama-swap's `scheduler.go` holds its interfaces the same way).

Events in: what the engines said of their own queues, devices and loads, a load that left the card,
a release to run (in the one line every release takes). Reads back: who is busy on a card reading,
the releases under way, whether a load is still on its way to the card. The scheduler
(`scheduler.py`) is the one object that implements it; the watchdog holds it as this protocol.

    watchdog = Watchdog(broker, engines)   # holds broker.scheduler as `Reports`
    reports.queue_read("comfyui", started_at, ("prompt-1",))
    released = await asyncio.shield(reports.release(order))   # never cut half way
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import TenantState
from proxy.handoff.policy import Releasing


class Reports(Protocol):
    def queue_read(self, tenant: str, started_at: float, job_ids: tuple[str, ...] | None) -> None:
        """What the engine's own queue said was running (None: it did not answer), read from `started_at`."""
        ...

    def on_cpu(self, tenant: str, cpu: bool) -> None:
        """What the engine said of its device."""
        ...

    def observe_loads(self, tenant: str, loads: Mapping[str, float]) -> None:
        """The engine's own list of what it holds (load key -> its own unload deadline)."""
        ...

    def unloaded(self, tenant: str, key: str | None = None) -> None:
        """This load (every load of the tenant, when None) may have left the card."""
        ...

    def release(self, order: ReleaseOrder, *, key: str | None = None,
                waiter: int | None = None) -> asyncio.Future[Released]:
        """Start a release (or line it up behind the one under way); await the future shielded."""
        ...

    def states(self, snap: AttributedSnapshot) -> dict[str, TenantState]:
        """Every tenant's busy state on `snap`."""
        ...

    @property
    def releasing(self) -> tuple[Releasing, ...]:
        """The releases under way or in line, whoever started them."""
        ...

    def loading(self, key: str) -> bool:
        """An admitted load under this key has not finished reaching the card."""
        ...

    def standing(self) -> Mapping[str, str]:
        """Load key -> tenant of every promise not ended yet (an admitted load still on its way)."""
        ...
