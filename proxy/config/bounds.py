"""Bounds: every number in the file has a sane range, so nonsense fails at load with its path
instead of at run time (1e300 GiB made every request 500, a negative timeout made every request
504 at once, a 0 s watchdog interval spun a core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

DAY_S = 86400.0
MAX_GIB = 16384.0  # 16 TiB: far above any card, far below where a byte count stops being exact


@dataclass(frozen=True, slots=True)
class Bound:
    """[low, high] in `unit`; `low_open`: low itself is refused (a zero timeout would fire at once)."""

    low: float
    high: float
    unit: str = ""
    low_open: bool = False

    def problem(self, value: float) -> str | None:
        too_low = value <= self.low if self.low_open else value < self.low
        if not too_low and value <= self.high:
            return None
        unit = f" {self.unit}" if self.unit else ""
        return f"must be {'>' if self.low_open else '>='} {_num(self.low)} and <= {_num(self.high)}{unit}, got {_num(value)}"


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 10**15:
        return f"a {x.bit_length()}-bit integer"  # float(x) could overflow
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


# By field name (docs/reference/tenants-json.md is generated from them); names not here fall back to their
# suffix, so a field added later gets a range too.
BOUNDS: dict[str, Bound] = {
    "priority": Bound(-1_000_000, 1_000_000),
    "release_timeout_s": Bound(0, 3600, "s", low_open=True),
    "timeout_s": Bound(0, 3600, "s", low_open=True),  # one release step's own timeout
    "stop_timeout_s": Bound(0, 3600, "s"),  # 0: SIGKILL (docker: kill) at once
    "start_timeout_s": Bound(0, 3600, "s", low_open=True),
    "restart_limit": Bound(1, 1000, "restarts"),
    "idle_release_after_s": Bound(0, 30 * DAY_S, "s"),  # 0: release as soon as it goes idle
    "connect_s": Bound(0, 3600, "s", low_open=True),
    "read_s": Bound(0, DAY_S, "s", low_open=True),
    "write_s": Bound(0, DAY_S, "s", low_open=True),
    "pool_s": Bound(0, DAY_S, "s", low_open=True),
    "watchdog_interval_s": Bound(0.05, 3600, "s"),  # each tick reads the GPU and polls the engines
    "release_poll_s": Bound(0.01, 10, "s"),  # each poll reads the GPU
    "queue_timeout_s": Bound(0, DAY_S, "s"),  # 0: never wait for a handoff, answer 503 at once
    "job_lost_after_s": Bound(0, DAY_S, "s", low_open=True),
    "retention_days": Bound(0, 3650, "days", low_open=True),  # 0 would delete every row at open
    "max_rows": Bound(1, 100_000_000, "rows"),
    "replay_body_max_mb": Bound(0, 1024, "MiB"),  # kept in memory while the request runs
    # gpu_profile: wide enough for any card; the card's own range is checked against what NVML reports
    "power_limit_w": Bound(1, 5000, "W"),
    "gpc_clock_offset_mhz": Bound(-5000, 5000, "MHz"),
    "mem_clock_offset_mhz": Bound(-10000, 10000, "MHz"),
    "fan_speed_percent": Bound(0, 100, "%"),
    "device": Bound(0, 63),
    "check_interval_s": Bound(1, 3600, "s"),  # each check reads the card's settings through NVML
    "keep_warm_models": Bound(0, 1000, "models"),
    "overtake_limit": Bound(0, 1000, "requests"),  # 0: strict arrival order, a swap for every change of tenant
    "swap_hold_s": Bound(0, 60, "s"),  # 0: off; a hold is added to a swap's latency, so it stays short
    "swap_hold_recent_s": Bound(0, 3600, "s"),
}
SUFFIX_BOUNDS: dict[str, Bound] = {"_gb": Bound(0, MAX_GIB, "GiB"), "_s": Bound(0, DAY_S, "s")}


def bound_for(field: str) -> Bound | None:
    if field in BOUNDS:
        return BOUNDS[field]
    return next((b for suffix, b in SUFFIX_BOUNDS.items() if field.endswith(suffix)), None)


def is_number(value: object) -> TypeGuard[float]:
    """An int or a float, never a bool (JSON's true is no number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)

