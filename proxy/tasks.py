"""Background-task helpers shared by the watchdog, the extensions and the job poller."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterable


async def cancel_and_wait(tasks: "asyncio.Task[Any] | Iterable[asyncio.Task[Any]] | None") -> None:
    """Cancel, then wait until each task has really finished (so nothing runs after stop())."""
    if tasks is None:
        return
    group = [tasks] if isinstance(tasks, asyncio.Task) else list(tasks)
    for task in group:
        task.cancel()
    for task in group:
        with contextlib.suppress(asyncio.CancelledError):
            await task
