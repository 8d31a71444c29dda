"""The Registry the proxy runs from: the merged, validated configuration and where each value came
from (the user's file or the shipped defaults)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path

from proxy.config.schema import Config, Tenant
from proxy.errors import UnknownTenant

SETTINGS_SECTIONS = ("admin", "proxy", "telemetry", "gpu_profile")


@dataclass(frozen=True, slots=True)
class Registry:
    """The merged, validated tenants, plus where each value came from."""

    config: Config
    source: Path | None  # the user file, or None for shipped defaults alone
    provenance: Mapping[str, Mapping[str, str]]  # tenant -> dotted field -> "user" | "default"
    # the other sections (admin, proxy, telemetry, gpu_profile): dotted field -> "user" | "default"
    settings_provenance: Mapping[str, str] = dc_field(default_factory=dict)

    @property
    def tenants(self) -> Mapping[str, Tenant]:
        return self.config.tenants

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.config.tenants.values())

    def __len__(self) -> int:
        return len(self.config.tenants)

    def __contains__(self, name: object) -> bool:
        return name in self.config.tenants

    def get(self, name: str) -> Tenant:
        try:
            return self.config.tenants[name]
        except KeyError:
            known = ", ".join(self.config.tenants) or "none"
            raise UnknownTenant(f"unknown tenant {name!r}", fix=f"use one of: {known}") from None


def setting_value(config: Config, dotted: str) -> object:
    """A section's field as JSON would show it (`proxy.queue_timeout_s` -> 300.0)."""
    section, key = dotted.split(".", 1)
    return getattr(config, section).model_dump(mode="json")[key]



def field_value(tenant: Tenant, dotted: str) -> object:
    value: object = tenant.model_dump()
    for part in dotted.split("."):
        if not isinstance(value, dict):
            raise KeyError(part)  # a leaf has no fields under it
        value = value[part]
    return value
