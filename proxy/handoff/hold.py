"""Holding a swap briefly, weighed by what it would cost to undo (pure; `proxy.swap_hold_s`).

A swap away from a tenant whose work just ran bets that nobody asks for that tenant again soon. In
an interleaved burst (render, chat, render, chat, 150 ms apart) the bet loses: the next request for
the evicted model waits for a swap back, and the burst pays two loads instead of one (bench/mixed.py
measured 12.2 s against the oracle's 3.2 s for RCRC from the chat model). Holding the swap a moment
lets the requests for what is on the card that follow run first, so one swap serves the whole burst.

The hold is the classic rent-or-buy trade: waiting costs the requester up to the hold, a wrong swap
costs a reload. So it is weighed by the reload it risks: a swap is held at most `HOLD_SHARE` of the
time reading the released memory back would take at `RELOAD_BYTES_PER_S` (an estimate: the proxy
cannot see a disk's speed or the page cache), and never longer than `proxy.swap_hold_s`. A swap away
from a small model (0.5 GB: 38 ms) is barely held, one away from an SDXL checkpoint (7 GB) about half
a second, one away from a 17 GiB chat model the whole `swap_hold_s` (1 s: a burst sent within a
second is served by one swap; its reload is 8-9 s). Only a swap away from a tenant active within
`proxy.swap_hold_recent_s` is held at all: a lone swap away from an app nobody used lately starts at
once. The hold counts from the request's arrival, so a request that already waited that long for a
busy tenant to finish is not held again when it ends (a debounce from the tenant's last use would add
the whole hold to every wait behind a render), and it never applies past the fairness bound
(`policy.may_overtake`).

A tenant whose release parks its memory in host RAM (release kind `cuda_suspend`, `restores`) is
undone by a restore, not a reload: at `RESTORE_BYTES_PER_S` (a host-to-card copy) its swap risks a
sixth of a reload's time, and is held that much shorter (an SDXL checkpoint, 7 GB: about 90 ms, not half a second).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.config.schema import Tenant
from proxy.config.settings import ProxySettings
from proxy.handoff.inflight import TenantTraffic

RELOAD_BYTES_PER_S = 2e9  # a local NVMe read plus the copy to the card; a model in the page cache reloads faster
RESTORE_BYTES_PER_S = 12e9  # a restore from host RAM (cuda_suspend): a pinned copy over PCIe 4.0 x16, ~12-25 GB/s
HOLD_SHARE = 0.15  # of the reload a swap risks: a hold costs the requester at most 15 % of what it may save


class SwapRelease(Protocol):
    """What a hold needs of each release a swap would make (`plan.Release`)."""
    @property
    def tenant(self) -> str: ...
    @property
    def expected_free_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SwapHold:
    """`cap_s`: proxy.swap_hold_s (0: off). `recent`: the tenants whose work is open or ran or ended
    within proxy.swap_hold_recent_s (the only ones a swap away from is held). `restores`: the tenants
    whose release parks them in host RAM (undone by a restore, not a reload)."""
    cap_s: float = 0.0
    recent: frozenset[str] = frozenset()
    restores: frozenset[str] = frozenset()

    def hold_s(self, releases: Iterable[SwapRelease]) -> float:
        """How long a swap making `releases` is held: the share of the reload of what it releases
        from tenants active lately, at most `cap_s`; 0 when none of them was active lately."""
        risked_s = sum(r.expected_free_bytes / (RESTORE_BYTES_PER_S if r.tenant in self.restores else RELOAD_BYTES_PER_S)
                       for r in releases if r.tenant in self.recent)
        return min(self.cap_s, HOLD_SHARE * risked_s) if self.cap_s > 0 else 0.0

    def until(self, arrived_at: float, releases: Iterable[SwapRelease]) -> float | None:
        """When the swap of a request that arrived at `arrived_at` starts at the latest; None: not held."""
        hold = self.hold_s(releases)
        return arrived_at + hold if hold > 0 else None


NO_HOLD = SwapHold()


def swap_hold(settings: ProxySettings, tenants: Iterable[Tenant], traffic: Mapping[str, TenantTraffic],
              now: float) -> SwapHold:
    """proxy.swap_hold_s with the tenants it applies to now: those whose admitted work is open (active
    now) or ran or ended within proxy.swap_hold_recent_s; and those whose release parks them in host RAM."""
    if settings.swap_hold_s <= 0:
        return SwapHold()
    recent = frozenset(t for t, tr in traffic.items()
                       if tr.busy or (tr.last_activity is not None and now - tr.last_activity <= settings.swap_hold_recent_s))
    restores = frozenset(t.name for t in tenants if t.release_steps and t.release_steps[0].suspends)
    return SwapHold(settings.swap_hold_s, recent, restores)
