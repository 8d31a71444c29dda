"""What verify can drive, asked of each engine kind's adapter, and how an unexpected answer becomes a
failed stage: shared by the session (runner) and the stages, so neither imports the other for them."""

from __future__ import annotations

from proxy.engines.base import EngineAdapter
from proxy.engines.generic import GenericAdapter
from proxy.engines.registry import ADAPTERS
from proxy.verify.clients import TenantInfo, Unexpected
from proxy.verify.report import StageFailed

# The roles verify drives (the generation, graph, reclaim and OOM stages); each engine kind's adapter
# says which role its wire plays (`EngineAdapter.verify_role`), so no engine name is spelt here.
GENERATES, RENDERS = "generates", "renders"


def adapter_class(kind: str) -> type[EngineAdapter]:
    return ADAPTERS.get(kind, GenericAdapter)


def role_of(t: TenantInfo) -> str | None:
    return adapter_class(t.engine).verify_role


def kinds_for(role: str) -> str:
    """The engine kinds that play a role, for messages: "comfyui"."""
    return " or ".join(kind for kind, cls in ADAPTERS.items() if cls.verify_role == role)


def fails(exc: Unexpected, what: str, impact: str, fix: str) -> StageFailed:
    """An unexpected answer as a failed stage; the proxy's own fix wins when it gave one."""
    return StageFailed(f"{what}: {exc}", impact=impact, fix=exc.fix() or fix)
