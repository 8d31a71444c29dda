"""A bounded memo: what a hot path works out once per key and keeps, up to a number of keys.

Full, it is emptied and fills again: no eviction order to keep per use (an LRU's bookkeeping would
cost about what most of these memos save), a flood of new keys only misses, and the keys in use are
learnt again at once. Used where a request repeats what an earlier one asked (a Host, a route, a
request or answer head)."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memo: dict[K, V], key: K, value: V, most: int) -> V:
    """Keep `value` for `key` in `memo`, which holds at most `most` keys; `value` back."""
    if len(memo) >= most:
        memo.clear()
    memo[key] = value
    return value
