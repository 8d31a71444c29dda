"""The user's file merged over the shipped defaults field by field, remembering who set what.

A field added to the schema in a later release appears in an old config with its default value,
every explicit user value wins, and `"name": null` removes a shipped tenant. Provenance is kept
per path (`("tenants", "comfyui", "priority")` -> "user" | "removed") and turned into each field's
source ("user" or "default") once the result is validated."""

from __future__ import annotations

from collections.abc import Iterator

from proxy.config.registry import SETTINGS_SECTIONS
from proxy.config.schema import Config

Provenance = dict[tuple[str, ...], str]


def merge(base: object, override: object, path: tuple[str, ...], prov: Provenance) -> object:
    """Deep-merge override onto base; lists and scalars are replaced whole."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if key in out and value is None and path == ("tenants",):
                del out[key]  # "desktop": null removes a shipped tenant
                prov[(*path, key)] = "removed"
                continue
            out[key] = merge(out.get(key), value, (*path, key), prov) if key in out else value
            if not (isinstance(value, dict) and isinstance(base.get(key), dict)):
                _mark_user(value, (*path, key), prov)
        return out
    return override


def _mark_user(value: object, path: tuple[str, ...], prov: Provenance) -> None:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            _mark_user(inner, (*path, key), prov)
    else:
        prov[path] = "user"


def _leaves(value: object, prefix: str) -> Iterator[tuple[str, object]]:
    if isinstance(value, dict) and value and prefix.count(".") < 1:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, value


def settings_sources(config: Config, prov: Provenance) -> dict[str, str]:
    """Each field of the sections other than `tenants`, dotted (`proxy.queue_timeout_s`): user or default."""
    out: dict[str, str] = {}
    for section in SETTINGS_SECTIONS:
        value = getattr(config, section)
        if value is None:
            continue
        for key in value.model_dump():
            parts = (section, key)
            user = any(src == "user" and (k[:2] == parts or k == (section,)) for k, src in prov.items())
            out[f"{section}.{key}"] = "user" if user else "default"
    return out


def field_sources(config: Config, prov: Provenance) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, tenant in config.tenants.items():
        fields: dict[str, str] = {}
        for key, value in tenant.model_dump().items():
            if key == "name":
                continue
            for dotted, _ in _leaves(value, key) if isinstance(value, dict) and key != "model_vram_gb" else [(key, value)]:
                parts = ("tenants", name, *dotted.split("."))
                user = any(src == "user" and (k[:len(parts)] == parts or parts[:len(k)] == k)
                           for k, src in prov.items())
                fields[dotted] = "user" if user else "default"
        out[name] = fields
    return out
