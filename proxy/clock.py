"""Injected time. Anything that waits or times out takes a Clock, so tests never sleep.

Two clocks: `SystemClock` (the product) and `ManualClock` (tests). A test moves a ManualClock with
`await clock.advance(seconds)`; nothing in a test sleeps for real to cross a threshold.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

# advance() lets woken tasks run until every task waits again; a task that never waits (a busy
# loop of sleep(0)) must not hang it, so it gives up after this many loop turns.
_MAX_TURNS = 1000


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


class ManualClock:
    """Time that a test moves.

    `sleep()` really waits: each sleeper is a future with a deadline. `await advance(s)` first lets
    every task that can run reach its next wait, then moves time
    to each deadline it passes in turn, wakes that sleeper and lets every task that can run do so
    until all wait again, so a loop that sleeps again is woken again in the same advance if its next
    deadline is passed too; then time ends at now + s.

    `ticking=True`: time also passes at the system clock's pace and sleepers wake on it too. It is
    for a whole proxy or simulator under test (the demo box): their own polls and timeouts (a release
    polling the card, a model loading) must go on by themselves, while the test still jumps past a
    threshold (an idle deadline, a watchdog interval) with `advance`. Frozen time (the default)
    would hang every such poll until the test advanced it.
    """

    def __init__(self, start: float = 1000.0, wall_start: float = 1_796_000_000.0, *, ticking: bool = False) -> None:
        self._start = start
        self._wall_offset = wall_start - start
        self._ticking = ticking
        self._origin = time.monotonic()
        self._moved = 0.0  # what advance() added
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        t = self._start + self._moved
        return t + (time.monotonic() - self._origin) if self._ticking else t

    def wall(self) -> float:
        return self.now() + self._wall_offset

    def sleeping(self) -> int:
        """How many sleepers wait on this clock now."""
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    async def sleep(self, seconds: float) -> None:
        deadline = self.now() + max(0.0, seconds)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        while self._sleepers and self._sleepers[0][2].done():  # woken by real time, or cancelled
            heapq.heappop(self._sleepers)
        heapq.heappush(self._sleepers, (deadline, next(self._seq), fut))
        try:
            if not self._ticking:
                await fut
                return
            while not fut.done() and (left := deadline - self.now()) > 0:
                await asyncio.wait({fut}, timeout=left)
        finally:
            if not fut.done():
                fut.cancel()

    async def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, waking sleepers in deadline order and letting each run."""
        if seconds < 0:
            raise ValueError(f"time only moves forward (advance({seconds}))")
        await until_all_wait()  # tasks started before the advance reach their sleeps first
        target = self.now() + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            if fut.done():
                continue
            self._moved += max(0.0, deadline - self.now())
            fut.set_result(None)
            await until_all_wait()
        self._moved += max(0.0, target - self.now())
        await until_all_wait()


async def until_all_wait() -> None:
    """Let every task that can run do so, until each waits on something (a future, a socket, a timer,
    a thread): the event loop has nothing ready to run but this task. Trio calls it
    wait_all_tasks_blocked; asyncio has no public way to ask, so this reads the loop's ready queue
    (on a loop without one it yields a fixed number of turns)."""
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    for _ in range(_MAX_TURNS if ready is not None else 100):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return
