"""One adapter per engine kind; the tenant's `engine` field picks it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from proxy.engines.base import EngineAdapter, RequestKind, strip_hop_by_hop
from proxy.engines.comfyui import ComfyUIAdapter
from proxy.engines.generic import GenericAdapter
from proxy.engines.ollama import OllamaAdapter
from proxy.tenants import Tenant

ADAPTERS: Mapping[str, type[EngineAdapter]] = MappingProxyType({
    "ollama": OllamaAdapter,
    "comfyui": ComfyUIAdapter,
    "generic": GenericAdapter,
})


def adapter_for(tenant: Tenant) -> EngineAdapter:
    return ADAPTERS.get(tenant.engine, GenericAdapter)(tenant)


__all__ = ["ADAPTERS", "ComfyUIAdapter", "EngineAdapter", "GenericAdapter", "OllamaAdapter",
           "RequestKind", "adapter_for", "strip_hop_by_hop"]
