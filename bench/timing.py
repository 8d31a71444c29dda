"""The timing loop the CPU-bound benches share: warm up, then one perf_counter_ns sample per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], runs: int, warmup: int = 50) -> dict[str, float]:
    """Median, p99 and max in milliseconds over `runs` calls, after up to `warmup` unmeasured ones
    (caches, lazy imports and the allocator settle first)."""
    for _ in range(min(warmup, runs)):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    samples.sort()
    return {"runs": runs, "median_ms": statistics.median(samples),
            "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))], "max_ms": samples[-1]}
