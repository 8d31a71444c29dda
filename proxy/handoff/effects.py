"""What the scheduler does to the world (`HandoffEffects`): read the card, carry out a release, warm
a load's files. `Arbitration` is the real one; tests pass recording fakes (tests/unit/test_scheduler.py)
and a modelled box (tests/unit/test_scheduler_model.py).
"""

from __future__ import annotations

from typing import Protocol

from proxy.clock import Clock
from proxy.config.registry import Registry
from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.decisions import DecisionLog
from proxy.handoff.orders import Released, ReleaseOrder


class HandoffEffects(Protocol):
    """Everything the scheduler does to the world. `Arbitration` is the real one (the card reader
    and the releaser); tests pass recording fakes."""

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
