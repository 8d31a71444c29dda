"""Which adapter serves which engine kind: the one place a new kind is registered.

A new engine kind is one file (`proxy/engines/<kind>.py`, an `EngineAdapter` subclass overriding
the members of the ports (`ports.py`) where its engine differs from a generic HTTP app) plus one
line here; its name also goes in `proxy.config.schema.EngineKind` so tenants.json accepts it (a unit
test keeps the two in step). docs/design.md, "How to extend", has a worked example.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from proxy.config.schema import Tenant
from proxy.engines.base import EngineAdapter
from proxy.engines.comfyui import ComfyUIAdapter
from proxy.engines.generic import GenericAdapter
from proxy.engines.ollama import OllamaAdapter

ADAPTERS: Mapping[str, type[EngineAdapter]] = MappingProxyType({
    "ollama": OllamaAdapter,
    "comfyui": ComfyUIAdapter,
    "generic": GenericAdapter,
})


def adapter_for(tenant: Tenant) -> EngineAdapter:
    """A new adapter for the tenant (adapters hold per-tenant state: prefer an `AdapterCache`)."""
    return ADAPTERS.get(tenant.engine, GenericAdapter)(tenant)


class AdapterCache:
    """One adapter per tenant, made on first use and again when the tenant's configuration object
    changes; what an adapter learns is kept in `state_dir` (None: in memory only)."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self._adapters: dict[str, EngineAdapter] = {}
        self.state_dir = state_dir

    def __call__(self, tenant: Tenant) -> EngineAdapter:
        adapter = self._adapters.get(tenant.name)
        if adapter is None or adapter.tenant is not tenant:
            adapter = self._adapters[tenant.name] = adapter_for(tenant)
            adapter.keep_state_in(self.state_dir)
        return adapter
