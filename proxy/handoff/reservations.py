"""Memory promised to admitted loads that have not reached the card yet. Owned by the scheduler.

A load is admitted when the card shows room for it; its engine takes the memory some time later (a
model read from disk, a ComfyUI prompt that loads after `POST /prompt` returned). Until the
tenant's holding has grown by the load's need, that memory is promised: no later plan may hand it
to anyone else. Requests for the same load share one reservation (counted), so it lasts until the
last of them is done. Even then it is not forgotten at once: the card reading the next plan uses may
predate the load's arrival (a chat answered, its model on the card, while the last reading still
shows the memory free), so the promise stands until a reading taken after its end (`confirmed`).
Planning on such a stale reading without it admitted a render beside a chat model that had just
loaded, and the render ran out of memory (issue 40).
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
    ended_at: float | None = None  # its last request ended then; kept until a reading taken after it


class Reservations:
    def __init__(self) -> None:
        self._by_key: dict[str, _Reservation] = {}

    def reserve(self, key: str, plan: Plan) -> None:
        """Promise the load of `plan` its memory, or count one more request of a load promised already."""
        r = self._by_key.get(key)
        if r is not None and r.ended_at is None:
            r.count += 1
        else:  # new, or ended and awaiting a reading: a new load of its own (the old one is on the card)
            net = max(0, plan.need_bytes - plan.held_by_requester)
            self._by_key[key] = _Reservation(plan.requester, net, plan.held_by_requester, device=plan.device)

    def release(self, key: str, now: float) -> None:
        """One request of the load is done (or gave up): the last one ends the promise, which still
        counts until a card reading taken after `now` (`confirmed`) shows where its memory went."""
        r = self._by_key.get(key)
        if r is not None and r.ended_at is None:
            r.count -= 1
            if r.count <= 0:
                r.ended_at = now

    def confirmed(self, read_at: float) -> None:
        """A card reading taken at `read_at`: every promise that ended before it is seen there."""
        for key in [k for k, r in self._by_key.items() if r.ended_at is not None and r.ended_at <= read_at]:
            del self._by_key[key]

    def loading(self, key: str, tenant: str | None = None) -> bool:
        """An admitted load under this key (of `tenant`, when given) has not finished reaching the card."""
        r = self._by_key.get(key)
        return r is not None and r.ended_at is None and (tenant is None or r.tenant == tenant)

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
        return {key: r.tenant for key, r in self._by_key.items() if r.ended_at is None}
