"""Memory promised to admitted loads that have not reached the card yet. Owned by the scheduler.

A load is admitted when the card shows room for it; its engine takes the memory some time later (a
model read from disk, a ComfyUI prompt that loads after `POST /prompt` returned). Until the
tenant's holding has grown by the load's need, that memory is promised: no later plan may hand it
to anyone else. Requests for the same load share one reservation (counted), so it lasts until the
last of them is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff import per_card
from proxy.handoff.plan import Plan


@dataclass(slots=True)
class _Reservation:
    tenant: str
    need: int  # net: what the load adds to what the tenant held when admitted
    baseline: int  # what the tenant held when admitted; growth above it means the load arrived
    count: int = 1
    device: int | None = None  # the card it was admitted on, on a host with several


class Reservations:
    def __init__(self) -> None:
        self._by_key: dict[str, _Reservation] = {}

    def reserve(self, key: str, plan: Plan) -> None:
        """Promise the load of `plan` its memory, or count one more request of a load promised already."""
        r = self._by_key.get(key)
        if r is not None:
            r.count += 1
        else:
            net = max(0, plan.need_bytes - plan.held_by_requester)
            self._by_key[key] = _Reservation(plan.requester, net, plan.held_by_requester, device=plan.device)

    def release(self, key: str) -> None:
        """One request of the load is done (or gave up): the last one ends the promise."""
        r = self._by_key.get(key)
        if r is not None:
            r.count -= 1
            if r.count <= 0:
                del self._by_key[key]

    def loading(self, key: str, tenant: str | None = None) -> bool:
        """An admitted load under this key (of `tenant`, when given) has not finished reaching the card."""
        r = self._by_key.get(key)
        return r is not None and (tenant is None or r.tenant == tenant)

    def promised(self, snap: AttributedSnapshot) -> dict[str, tuple[str, int]]:
        """Load key -> (tenant, bytes) admitted loads will still take from free memory, as `snap` shows it."""
        out: dict[str, tuple[str, int]] = {}
        for key, r in self._by_key.items():
            grown = max(0, per_card.held_on(snap, r.tenant, r.device) - r.baseline)
            if r.need - grown > 0:
                out[key] = (r.tenant, r.need - grown)
        return out

    def tenants(self) -> Mapping[str, str]:
        """Load key -> tenant of every promise standing."""
        return {key: r.tenant for key, r in self._by_key.items()}
