"""pydantic's errors as the one-line messages people read: `path: what is wrong`, the path as
tenants.json spells it, without the tags pydantic adds for the shapes of `release`."""

from __future__ import annotations

from pydantic import ValidationError

from proxy.config.release import ONE_STEP, STEPS
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


def problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = err["loc"]
        path = ".".join(str(p) for p in loc if p not in (ONE_STEP, STEPS)) or "(top level)"
        msg = FRIENDLY.get(err["type"])
        if loc and loc[-1] in (ONE_STEP, STEPS) and err["type"] in ("model_type", "list_type"):
            msg = "expected an object (one release) or a list of them (steps tried in order)"
        if msg is None:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "literal_error":
                msg = msg.replace("Input should be", "expected")
        out.append(f"{path}: {msg}")
    return out


def schema_error(where: str, problems: list[str]) -> ConfigError:
    return ConfigError(f"{where} does not match the schema", problems=problems,
                       fix="correct the fields listed above; see the tenants.json reference, docs/reference/tenants-json.md")
