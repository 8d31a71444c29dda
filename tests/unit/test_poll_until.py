"""`poll_until`: the one polling loop, for state that changes with no event to wait on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from proxy.tasks import poll_until


async def test_returns_at_once_when_the_predicate_already_holds() -> None:
    looks: list[int] = []
    def look() -> bool:
        looks.append(1)
        return True

    await poll_until(look)
    assert looks == [1], "looked once, never slept"


async def test_looks_again_until_the_state_changes() -> None:
    state = {"n": 0}

    def ready() -> bool:
        state["n"] += 1
        return state["n"] >= 3

    await asyncio.wait_for(poll_until(ready, 0), 5)
    assert state["n"] == 3


async def test_an_async_predicate_is_awaited() -> None:
    answers: Iterator[dict[str, object]] = iter([{}, {}, {"p1": {"status": "success"}}])

    async def history() -> dict[str, object]:
        return next(answers)

    await asyncio.wait_for(poll_until(history, 0), 5)
    assert next(answers, None) is None, "stopped at the first truthy answer"
