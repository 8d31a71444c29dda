"""The one encoder of the dataclasses the API shows field by field (proxy/encoding.py), and that each of
them says what its admin view describes: the same fields, in the same order."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel

from proxy.admin import health_report
from proxy.encoding import fields_json
from proxy.gpu.visibility import Capability


def test_every_field_in_its_order_as_it_is_rounded_where_asked() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Sample:
        name: str
        seconds: float | None
        parts: tuple[int, ...]
        note: str | None = None

    assert fields_json(Sample("a", 1.23456, (1, 2))) == {"name": "a", "seconds": 1.23456, "parts": (1, 2), "note": None}
    assert list(fields_json(Sample("a", 1.23456, ()), {"seconds": 2})) == ["name", "seconds", "parts", "note"]
    assert fields_json(Sample("a", 1.23456, ()), {"seconds": 2})["seconds"] == 1.23
    assert fields_json(Sample("a", None, ()), {"seconds": 2})["seconds"] is None, "unknown stays unknown"


@pytest.mark.parametrize(("value", "view"), [
    (Capability("arbitration", "estimated", "on the engines' reports"), health_report.Capability),
])
def test_a_value_answers_with_the_fields_its_view_describes(value: object, view: type[BaseModel]) -> None:
    body = value.to_json()  # type: ignore[attr-defined]
    assert list(body) == list(view.model_fields), f"{type(value).__name__} and views.{view.__name__} differ"
    assert view.model_validate(body).model_dump(exclude_unset=True) == body
