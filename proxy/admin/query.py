"""Query parameters of the admin API, read strictly: a bad one is a 400 naming it, never a 500.

`float()` takes "nan", "inf" and "1e308", and turning those into bytes raised ValueError or
OverflowError deep in a handler (a 500); a limit above its maximum was quietly clamped. Every
number read here is finite and inside the range the OpenAPI document states.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from proxy.errors import HyperSwapError


class BadQuery(HyperSwapError):
    status = 400
    exit_code = 2


def optional_number(params: Mapping[str, str], name: str, *, low: float, high: float = math.inf,
                    example: str) -> float | None:
    """The parameter as a finite float in [low, high]; None when it is absent."""
    raw = params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not low <= value <= high:
        upper = "" if high == math.inf else f" to {high:g}"
        raise BadQuery(f"{name} must be a finite number from {low:g}{upper}, got {raw!r}", fix=example)
    return value


def integer(params: Mapping[str, str], name: str, default: int, *, low: int, high: int, example: str) -> int:
    """The parameter as an int in [low, high] (no silent clamping); `default` when it is absent."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:  # "ten", "1e3", thousands of digits
        value = low - 1
    if not low <= value <= high:
        raise BadQuery(f"{name} must be an integer from {low} to {high}, got {raw[:40]!r}", fix=example)
    return value
