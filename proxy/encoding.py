"""How the proxy writes JSON: each shape it writes (a plan, a decision, a health report...) is one
typed model (`JSONModel`), the one the admin API documents, and is written through it (`dump`); a
value whose shape is open (an engine's answer, a decision's merged facts) is a `JSONValue`.

`JSONValue` is the JSON value type, recursive and defined once here: the JSON edges say what they carry.

A dataclass whose JSON is its fields is its own schema: pydantic writes it (`TypeAdapter`) and the
admin document describes it, with no hand-written dict that names the fields again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union, cast

from pydantic import BaseModel, ConfigDict
from typing_extensions import TypeAliasType

# A JSON value: what json.loads gives and json.dumps takes (a tuple is written as an array).
JSONValue = TypeAliasType(
    "JSONValue", Union[str, int, float, bool, "list[JSONValue]", "tuple[JSONValue, ...]", "dict[str, JSONValue]", None])
JSONObject = dict[str, JSONValue]


class JSONModel(BaseModel):
    """The base of every shape the proxy writes and the admin API documents. Unknown keys are kept
    (`extra="allow"`): a payload that grows a field stays valid, and the document says what is promised."""

    model_config = ConfigDict(extra="allow")

    def dump(self) -> JSONObject:
        """The model as its JSON answer carries it: a field nobody set is left out, not invented
        (unknown is absent or null, never a made-up default)."""
        return cast(JSONObject, self.model_dump(mode="json", exclude_unset=True, by_alias=True))


def read_json(value: Mapping[str, object]) -> JSONObject:
    """A mapping read from JSON (an engine's answer, what a step asked), as the JSON object it is."""
    return cast(JSONObject, dict(value))


def as_object(value: object) -> JSONObject:
    """`value` (read from JSON) as an object, or an empty one when it is not an object."""
    return cast(JSONObject, value) if isinstance(value, dict) else {}
