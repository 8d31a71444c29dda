"""What the retry after an out-of-memory failure is planned with.

The failure says the estimate was short: the retry asks for more than the tenant could reach when
it failed, that is what it holds plus what is free, plus `OOM_HEADROOM_BYTES`, so the plan releases
idle tenants for it. Two things keep that from refusing a retry that can run:

- the card is read afresh after the failure (`GpuBroker.admit`), never the reading taken while
  the job ran: ComfyUI frees its models when it fails ("Got an OOM, unloading all loaded models"),
  and a reading taken while it sampled counted memory twice (24.3 GiB held and 0.25 free on a card
  of 23.7), so a 10 GiB render's retry asked for more than the card and got 507 "too large";
- the raised need is capped at what the tenant could ever reach (free, its own, and every tenant it
  may release or wait for: `Plan.reachable_bytes`): when nobody else holds memory, the retry runs
  on all there is instead of being refused for the headroom. The estimate itself is never lowered,
  so a request larger than anything reachable is still refused as before.
"""

from __future__ import annotations

from proxy.config.units import GIB

OOM_HEADROOM_BYTES = 1 * GIB  # after an OOM the estimate was wrong: ask for this much more than is free


def oom_retry_need(estimate: int, held: int, free: int, reachable: int | None) -> int:
    """The need of the retry: `estimate` (the request's own need), raised to `held` + `free` (a
    fresh card reading) + headroom, the raise capped at `reachable` (None: unknown, uncapped)."""
    raised = held + free + OOM_HEADROOM_BYTES
    if reachable is not None:
        raised = min(raised, reachable)
    return max(estimate, raised)
