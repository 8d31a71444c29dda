"""One adapter per engine kind; the tenant's `engine` field picks it (see `registry`)."""

from __future__ import annotations

from proxy.engines.base import EngineAdapter, strip_hop_by_hop
from proxy.engines.comfyui import ComfyUIAdapter
from proxy.engines.common import Need, ReleaseFailed
from proxy.engines.generic import GenericAdapter
from proxy.engines.ollama import OllamaAdapter
from proxy.engines.ports import RequestKind
from proxy.engines.registry import ADAPTERS, AdapterCache, adapter_for
from proxy.engines.release_kinds import RELEASE_KINDS

__all__ = [
           "ADAPTERS",
           "RELEASE_KINDS",
           "AdapterCache",
           "ComfyUIAdapter",
           "EngineAdapter",
           "GenericAdapter",
           "Need",
           "OllamaAdapter",
           "ReleaseFailed",
           "RequestKind",
           "adapter_for",
           "strip_hop_by_hop",
]
