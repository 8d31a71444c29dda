"""Admin-side features that plug into the proxy: each adds routes to the admin listener and may run
background work (telemetry writer, events ticker). Read-mostly: they observe the proxy's owners
(broker, inflight, decisions, watchdog) through a read-only `ProxyView` and never take part
in a handoff. A new feature is one line in `default_extensions()`: a factory taking the view."""

# One line per extension (import and append together) keeps each addition a one-line change that
# merges cleanly; the imports are on first use so the service never imports the features it serves.
# ruff: noqa: E501, E702, I001

from __future__ import annotations

from collections.abc import Callable

from proxy.admin.proxy_view import Extension, ProxyView

ExtensionFactory = Callable[[ProxyView], Extension]

__all__ = ["Extension", "ExtensionFactory", "ProxyView", "default_extensions"]


def default_extensions() -> list[ExtensionFactory]:
    """Every extension the proxy runs, in start order (stopped in reverse). One line each."""
    factories: list[ExtensionFactory] = []
    from proxy.admin.health import health_extension; factories.append(health_extension)  # /api/health, /api/engines
    from proxy.admin.events import events_extension; factories.append(events_extension)  # /api/events (SSE)
    from proxy.admin.telemetry import telemetry_extension; factories.append(telemetry_extension)  # SQLite history, /api/history
    from proxy.admin.metrics import metrics_extension; factories.append(metrics_extension)  # /metrics (Prometheus)
    from proxy.admin.dashboard import dashboard_extension; factories.append(dashboard_extension)  # / and /static/{path} (the dashboard)
    from proxy.admin.models_api import models_extension; factories.append(models_extension)  # /api/models: model files in RAM, warming, load speeds
    from proxy.admin.mcp_extra import mcp_extension; factories.append(mcp_extension)  # /mcp (MCP tools, streamable HTTP; 501 without the [mcp] extra)
    from proxy.admin.gpu_api import gpu_extension; factories.append(gpu_extension)  # /api/gpu, gpu_profile drift and apply
    from proxy.admin.openapi import OpenApiExtension; factories.append(OpenApiExtension)  # /openapi.json
    return factories
