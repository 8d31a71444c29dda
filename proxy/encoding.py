"""One encoder for the values the API shows field by field: a frozen dataclass's fields, in the order
they are declared, as they are (JSON turns tuples into arrays), a float rounded where its field says so.

A dataclass whose JSON is its fields answers `to_json` with this instead of a hand-written dict that
names them again (and can forget one); the admin views (admin/views.py) describe the same fields, and
tests/unit/test_views.py reads the answers back through them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def fields_json(obj: DataclassInstance, rounded: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Every field by name, in declaration order; `rounded`: field name -> decimals (None stays None)."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    for name, digits in (rounded or {}).items():
        if out[name] is not None:
            out[name] = round(out[name], digits)
    return out
