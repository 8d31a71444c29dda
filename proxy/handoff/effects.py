"""What the scheduler does to the world (`HandoffEffects`): read the card, carry out a release, warm
a load's files. `GpuBroker` is the real one; `ScriptedEffects` is the fake the tests drive the
scheduler with (tests/unit/test_scheduler.py over a card it edits, tests/unit/test_scheduler_model.py
over a modelled box), as httpx ships `MockTransport` for its transport seam.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.decisions import DecisionLog, HandoffStarted, ReleaseResult
from proxy.handoff.orders import Released, ReleaseOrder
from proxy.handoff.plan import Release


class HandoffEffects(Protocol):
    """Everything the scheduler does to the world. `GpuBroker` is the real one (its `CardReader`
    and `ReleaseRunner`); tests pass recording fakes."""

    clock: Clock
    registry: Registry
    decisions: DecisionLog

    async def read_card(self) -> AttributedSnapshot:
        """Read the card (one read at a time, off the loop; a broken reader falls back to the engines'
        own reports). Run by the scheduler as a task that posts the reading, never inside a pass."""

    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        """Record the order, release what it says (never a tenant that is busy by then, by
        `Scheduler.states`), wait for the memory. `fresh`: read the card again first (the order
        waited in line behind another release). Run by the scheduler as a task, never awaited by a
        pass."""

    def prepare_load(self, tenant: str, model: str) -> None:
        """This load will run once memory is released or a busy tenant finishes: let its files be
        read into RAM meanwhile (warm-during-release). Must not block."""


async def freed_as_expected(release: Release) -> ReleaseResult:
    """A release that frees what was expected at once, confirmed: `ScriptedEffects`' default."""
    return ReleaseResult(release.tenant, release.expected_free_bytes, release.expected_free_bytes, 0.0, True)


class ScriptedEffects:
    """`HandoffEffects` for tests: the card is what `card()` returns, each tenant's release is what
    `release(step)` answers, and every effect is written to `log` in order. As `GpuBroker`, an order
    is recorded as one `HandoffStarted` decision before anything is asked, and a tenant that `busy`
    says has work when its turn comes is never asked (its result says busy).

        effects = ScriptedEffects(registry, clock, card=lambda: snapshot)
        scheduler = Scheduler(effects, inflight)
        ...
        assert effects.log == [("read",), ("release", ("comfyui",))]
    """

    def __init__(self, registry: Registry, clock: Clock, card: Callable[[], AttributedSnapshot],
                 release: Callable[[Release], Awaitable[ReleaseResult]] = freed_as_expected,
                 busy: Callable[[str], bool] = lambda tenant: False) -> None:
        self.registry = registry
        self.clock = clock
        self.decisions = DecisionLog(clock)
        self.current_card = card  # what the card shows now (not `card`: that name is the scheduler's own state)
        self.release = release
        self.busy = busy
        self.log: list[tuple[object, ...]] = []  # ("read",), ("release", tenants), ("prepare_load", tenant, model)

    async def read_card(self) -> AttributedSnapshot:
        self.log.append(("read",))
        return self.current_card()

    async def carry_out(self, order: ReleaseOrder, fresh: bool) -> Released:
        self.log.append(("release", tuple(r.tenant for r in order.releases)))
        started = self.decisions.emit(HandoffStarted(kind=order.kind, tenant=order.requester, trigger=order.trigger,
                                                     plan=order.plan))
        results = []
        for step in order.releases:
            if self.busy(step.tenant):
                results.append(ReleaseResult(step.tenant, step.expected_free_bytes, 0, 0.0, False, "busy", busy=True))
            else:
                results.append(await self.release(step))
        return Released(order, results, started)

    def prepare_load(self, tenant: str, model: str) -> None:
        self.log.append(("prepare_load", tenant, model))
