"""The tenants.json reference, from the pydantic models of proxy/config/schema.py: every field with its type,
default, range (the `BOUNDS` table, else its suffix, else the field's own ge/le) and description.

A field without a description is refused here, so a new field cannot reach the page undocumented."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from docs.gen.md import code, table
from proxy.config.bounds import BOUNDS, SUFFIX_BOUNDS, Bound, bound_for
from proxy.config.kinds import ReleaseKinds
from proxy.config.schema import Config, ReleaseSpec, Tenant
from proxy.config.settings import AdminSpec, GpuProfile, ProxySettings, TelemetrySettings
from proxy.engines.loading import registry_from_dict
from proxy.engines.release_kinds import KINDS


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def bound_text(bound: Bound) -> str:
    unit = f" {bound.unit}" if bound.unit else ""
    if bound.low_open:
        return f"above {_num(bound.low)}, at most {_num(bound.high)}{unit}"
    return f"{_num(bound.low)} to {_num(bound.high)}{unit}"


def _args(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _strip(annotation: Any) -> Any:
    return _args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def type_text(annotation: Any) -> str:
    annotation = _strip(annotation)
    origin = typing.get_origin(annotation)
    if _is_union(annotation):
        parts = [a for a in _args(annotation) if a is not type(None)]
        text = " or ".join(type_text(a) for a in parts)
        return text + (" or null" if len(parts) < len(_args(annotation)) else "")
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in _args(annotation))
    if origin is list:
        inner = type_text(_args(annotation)[0])
        return "list of " + ("objects" if inner == "object" else inner + "s" if " " not in inner else f"({inner})")
    if origin is dict:
        inner = _args(annotation)[1]
        return "object" if inner is Any or inner is object else f"object of {type_text(inner)}s"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation in names:
        return names[annotation]
    if annotation is Any:
        return "any JSON"
    raise ValueError(f"docs/gen/config.py cannot name the type {annotation!r}: teach type_text() about it")


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds (itself, in a list, or in a union), in order."""
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if _is_union(annotation) or typing.get_origin(annotation) is list:
        found: list[type[BaseModel]] = []
        for a in _args(annotation):
            found += [m for m in _models(a) if m not in found]
        return found
    return []


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return code(json.dumps(value))


def range_text(name: str, info: FieldInfo) -> str:
    parts = []
    bound = bound_for(name)
    if bound is not None:
        each = "each value " if typing.get_origin(_strip(info.annotation)) is dict else ""
        parts.append(each + bound_text(bound))
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            parts.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Le):
            parts.append(f"<= {m.le}")
    return ", ".join(parts)


def rows(model: type[BaseModel], prefix: str = "", kinds: ReleaseKinds = KINDS) -> Iterator[list[str]]:
    yield from _rows(model.__name__, model.model_fields, prefix, kinds)


def release_rows(prefix: str, kinds: ReleaseKinds = KINDS) -> Iterator[list[str]]:
    """One release step: the fields of every registered release kind (the base's first, then each
    kind's own in registration order), `kind` naming every kind."""
    fields = kinds.fields()
    kind = fields.pop("kind")
    yield [code(f"{prefix}kind"), " or ".join(json.dumps(k) for k in kinds), default_text(kind), "",
           kind.description or ""]
    yield from _rows("ReleaseSpec", fields, prefix, kinds)


def _rows(owner: str, fields: dict[str, FieldInfo], prefix: str, kinds: ReleaseKinds) -> Iterator[list[str]]:
    for name, info in fields.items():
        dotted = f"{prefix}{name}"
        if not info.description:
            raise ValueError(f"{owner}.{name} ({dotted}) has no description: give it Field(description=...); "
                             "the tenants.json reference is made from them")
        yield [code(dotted), type_text(info.annotation), default_text(info), range_text(name, info), info.description]
        for sub in _models(info.annotation):
            yield from release_rows(f"{dotted}.", kinds) if sub is ReleaseSpec else rows(sub, f"{dotted}.", kinds)


HEADERS = ("field", "type", "default", "range", "meaning")


def _section(title: str, model: type[BaseModel], prefix: str, intro: str, kinds: ReleaseKinds = KINDS) -> str:
    return f"## {title}\n\n{intro}\n\n{table(HEADERS, rows(model, prefix, kinds))}"


def shipped() -> str:
    registry = registry_from_dict({})
    out = []
    for t in registry.tenants.values():
        kinds = ", ".join(step.kind for step in t.release_steps)
        out.append([code(t.name), t.engine, code(t.listen or "-"), code(t.upstream or "-"), str(t.priority),
                    _num(t.needs_vram_gb), kinds, "never" if t.idle_release_after_s is None else
                    f"{_num(t.idle_release_after_s)} s", _num(t.idle_vram_gb)])
    return table(("tenant", "engine", "listen", "upstream", "priority", "needs_vram_gb", "release", "idle release",
                  "idle_vram_gb"), out)


def suffix_rules() -> str:
    named = ", ".join(code(n) for n in BOUNDS)
    rules = "; ".join(f"any other field ending in {code(s)}: {bound_text(b)}" for s, b in SUFFIX_BOUNDS.items())
    return f"Fields with a range of their own: {named}. {rules.capitalize()}."


def render(kinds: ReleaseKinds = KINDS) -> str:
    """The page for the proxy's release kinds (`kinds`: another set, a test's own kind added)."""
    top = [[code(name), type_text(info.annotation), default_text(info), info.description or ""]
           for name, info in Config.model_fields.items()]
    return "\n\n".join([
        "## The file\n\n" + table(("key", "type", "default", "meaning"), top),
        "## The shipped tenants\n\nWhat `tenants` holds before your file is merged over it (`proxy/defaults/"
        "tenants.json` in the package).\n\n"
        + shipped(),
        _section("A tenant: `tenants.NAME`", Tenant, "", "Every field of one application. `release` is one object or a "
                 "list of such objects (steps tried in order); its fields below are those of one step.", kinds),
        _section("`admin`", AdminSpec, "admin.", AdminSpec.__doc__ or ""),
        _section("`proxy`", ProxySettings, "proxy.", ProxySettings.__doc__ or ""),
        _section("`telemetry`", TelemetrySettings, "telemetry.", "The stored history (`GET /api/history`)."),
        _section("`gpu_profile`", GpuProfile, "gpu_profile.", " ".join((GpuProfile.__doc__ or "").split())),
        "## Ranges\n\n" + suffix_rules(),
    ])
