"""Background-task helpers shared by the watchdog, the extensions and the job poller."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Iterable

from proxy.clock import Clock


async def cancel_and_wait(tasks: asyncio.Task[object] | Iterable[asyncio.Task[object]] | None) -> None:
    """Cancel, then wait until each task has really finished (so nothing runs after stop())."""
    if tasks is None:
        return
    group = [tasks] if isinstance(tasks, asyncio.Task) else list(tasks)
    for task in group:
        task.cancel()
    for task in group:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def sleep_or_wake(clock: Clock, seconds: float, wake: asyncio.Event) -> None:
    """Sleep on the injected clock, or less if `wake` is set meanwhile (or already is)."""
    if wake.is_set():
        return
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waker = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waker.cancel()


async def poll_until(predicate: Callable[[], object], every_s: float = 0.005) -> None:
    """Return once `predicate()` (or what it returns, if that is awaitable) is truthy, looking every
    `every_s`. Only for state that changes with no event to wait on (a simulated GPU's memory,
    uvicorn's connection set, counters another object owns, an HTTP endpoint); bound the wait with
    `asyncio.timeout`."""
    # The one polling loop: ASYNC110's "use an Event" has no event to use here.
    while not await _resolved(predicate()):  # noqa: ASYNC110
        await asyncio.sleep(every_s)


async def _resolved(value: object) -> object:
    return await value if inspect.isawaitable(value) else value
