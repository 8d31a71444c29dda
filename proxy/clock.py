"""Injected time. Anything that waits or times out takes a Clock, so tests never sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""

    def wall(self) -> float:
        """Unix seconds, for timestamps shown to people."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that only moves when told to (or when someone sleeps on it)."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_796_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)
