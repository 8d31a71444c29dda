"""Admin-side features that plug into the proxy: each adds routes to the admin listener and may run
background work (telemetry writer, events ticker). Read-mostly: they observe the proxy's owners
(arbitration, inflight, decisions, watchdog) and never take part in a handoff."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from starlette.routing import BaseRoute

if TYPE_CHECKING:
    from proxy.service import Proxy


class Extension(Protocol):
    def routes(self) -> list[BaseRoute]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


ExtensionFactory = Callable[["Proxy"], Extension]


def default_extensions() -> list[ExtensionFactory]:
    """Every extension the proxy runs, in start order (stopped in reverse). One line each."""
    factories: list[ExtensionFactory] = []
    from proxy.admin.health import health_extension; factories.append(health_extension)  # /api/health, /api/engines
    from proxy.admin.events import events_extension; factories.append(events_extension)  # /api/events (SSE)
    from proxy.admin.telemetry import telemetry_extension; factories.append(telemetry_extension)  # SQLite history, /api/history
    from proxy.admin.metrics import metrics_extension; factories.append(metrics_extension)  # /metrics (Prometheus)
    from proxy.admin.dashboard import dashboard_extension; factories.append(dashboard_extension)  # / and /static/{path} (the dashboard)
    from proxy.admin.models_api import models_extension; factories.append(models_extension)  # /api/models: model files in RAM, warming, load speeds
    from proxy.admin.mcp_tools import mcp_extension; factories.append(mcp_extension)  # /mcp (MCP tools, streamable HTTP)
    from proxy.admin.openapi import OpenApiExtension; factories.append(OpenApiExtension)  # /openapi.json
    return factories
