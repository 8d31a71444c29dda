"""pydantic's errors as the one-line messages people read: `path: what is wrong`, the path as
tenants.json spells it, without the tags pydantic adds for the shapes of `release`."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from proxy.config.schema import ONE_STEP, STEPS, ReleaseSpec, is_tag
from proxy.errors import ConfigError

FRIENDLY = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "list_type": "expected a list",
    "finite_number": "expected a finite number (not NaN or Infinity)",
    "missing": "required field is missing",
    "extra_forbidden": "unknown key (check the spelling against the tenants.json reference, docs/reference/tenants-json.md)",
}


def problems(exc: ValidationError, kinds: Mapping[str, type[ReleaseSpec]]) -> list[str]:
    """Each error as `path: what is wrong`; `kinds`: the release kinds the file was validated with."""
    out = []
    for err in exc.errors():
        loc = err["loc"]
        path = ".".join(str(p) for p in loc if not is_tag(p)) or "(top level)"
        msg = FRIENDLY.get(err["type"])
        if loc and loc[-1] in (ONE_STEP, STEPS) and err["type"] in ("model_type", "list_type", "union_tag_not_found"):
            msg = "expected an object (one release) or a list of them (steps tried in order)"
        elif err["type"] == "union_tag_not_found":  # a step of a list that is no object
            msg = FRIENDLY["model_type"]
        elif err["type"] == "union_tag_invalid":  # `kind` names no registered release kind
            path, msg = f"{path}.kind", _expected(list(kinds))
        elif err["type"] == "extra_forbidden" and len(loc) > 1 and str(loc[-2]).startswith("(kind ") \
                and _taking(kinds, str(loc[-1])):
            msg = _other_kinds_field(str(loc[-1]), str(loc[-2]), kinds)
        if msg is None:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "literal_error":
                msg = msg.replace("Input should be", "expected")
        out.append(f"{path}: {msg}")
    return out


def _expected(values: list[str]) -> str:
    """As pydantic words a Literal's values: `expected 'a', 'b' or 'c'`."""
    quoted = [repr(v) for v in values]
    return "expected " + (f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0])


def _taking(kinds: Mapping[str, type[ReleaseSpec]], field: str) -> list[str]:
    return sorted(name for name, model in kinds.items() if field in model.model_fields)


def _other_kinds_field(field: str, tag: str, kinds: Mapping[str, type[ReleaseSpec]]) -> str:
    """A field of another release kind, named at its own path, so a typo in `kind` cannot silently
    drop a command."""
    kind = tag.removeprefix("(kind ").removesuffix(")")
    taking = " or ".join(repr(k) for k in _taking(kinds, field))
    return f"only release kind {taking} takes {field!r} (this release is kind {kind!r})"


def schema_error(where: str, problems: list[str]) -> ConfigError:
    return ConfigError(f"{where} does not match the schema", problems=problems,
                       fix="correct the fields listed above; see the tenants.json reference, docs/reference/tenants-json.md")
