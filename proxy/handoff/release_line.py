"""The release line: releases run one at a time, whoever asked (the queue's own plans, the watchdog,
the admin API), the next waiting in line here as state, not on a lock.

Each release runs as a task that reports back (`on_done`), the way llama-swap's scheduler starts a
swap and hears `OnSwapDone`; the scheduler (`scheduler.py`) decides what its end means for the
requests that joined it, then calls `finished` so the next in line runs. What a release under way
holds (its tenants, the load it makes room for, the memory that load is promised) is read here by
each pass, so no plan undoes it. State only; the scheduler is the one that changes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator

from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.policy import Releasing
from proxy.handoff.tickets import Underway

CarryOut = Callable[[ReleaseOrder, bool], Coroutine[object, object, Released]]  # `HandoffEffects.carry_out`
OnDone = Callable[[Underway, "asyncio.Task[Released]"], None]


class ReleaseLine:
    """The release running first, then those in line behind it."""

    def __init__(self, carry_out: CarryOut, on_done: OnDone) -> None:
        self._carry_out = carry_out
        self._on_done = on_done
        self._line: list[Underway] = []

    def __iter__(self) -> Iterator[Underway]:
        return iter(self._line)

    def __bool__(self) -> bool:
        return bool(self._line)

    @property
    def states(self) -> tuple[Releasing, ...]:
        """The releases under way or in line, whoever started them."""
        return tuple(u.state for u in self._line)

    def start(self, order: ReleaseOrder, key: str | None, waiter: int | None) -> Underway:
        """Line a release up; it runs at once when nothing runs ahead of it. `key`, `waiter`: the
        load it makes room for and the request that asked (None: a release with no load behind it)."""
        state = Releasing(tuple(r.tenant for r in order.releases), key, waiter,
                          order.requester if key is not None else "")
        underway = Underway(state, order, asyncio.get_running_loop().create_future())
        self._line.append(underway)
        if len(self._line) == 1:
            self._run(underway, fresh=False)
        return underway

    def finished(self, underway: Underway) -> None:
        """It reported back: out of the line, and the next in line runs (on a fresh card: the one it
        was ordered on may be out of date)."""
        if underway in self._line:
            self._line.remove(underway)
        if self._line and self._line[0].task is None:
            self._run(self._line[0], fresh=True)

    def _run(self, underway: Underway, *, fresh: bool) -> None:
        task = asyncio.create_task(self._carry_out(underway.order, fresh),
                                   name=f"hyperswap:release:{','.join(underway.state.tenants)}")
        underway.task = task
        task.add_done_callback(lambda t: self._on_done(underway, t))

    def for_load(self, key: str) -> Underway | None:
        """The release under way (or in line) that makes room for this load."""
        return next((u for u in self._line if u.state.key == key), None)

    def promised_away(self, tenant: str) -> bool:
        """A release that makes room for a load counts on this tenant's memory: it must not be undone."""
        return any(tenant in u.state.tenants for u in self._line if u.state.key is not None)

    def claims(self, claims: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
        """`claims` (load key -> (tenant, bytes) promised) with what the loads the releases make room
        for take from free memory meanwhile added."""
        for u in self._line:
            if (claim := u.claim) is not None and u.state.key is not None:
                # the same load may be reserved already (a request for it admitted while the release
                # runs): one load, so the larger promise stands, never the release's smaller claim
                old = claims.get(u.state.key)
                claims[u.state.key] = (claim[0], max(claim[1], old[1] if old else 0))
        return claims

    def cancel(self) -> list[asyncio.Task[Released]]:
        """The proxy stops: every future in line cancelled; the tasks running, for the caller to await."""
        for u in self._line:
            if not u.done.done():
                u.done.cancel()
        return [u.task for u in self._line if u.task is not None]
