"""Any HTTP app: POST/PUT may need the GPU, everything else passes through (base behaviour)."""

from __future__ import annotations

from proxy.engines.base import EngineAdapter


class GenericAdapter(EngineAdapter):
    kind = "generic"
