"""The MCP tools are an optional extra: `pip install '.[mcp]'` (from the checkout) adds the `mcp` SDK they need.

Without it the proxy runs as before and says what is missing where the tools would be:
- `/mcp` on the admin listener answers 501 `{"error", "fix"}` (`mcp_extension`);
- `hyperswap mcp` and `python -m proxy.admin.mcp_tools` print one line with the fix and exit 2.
This module never imports the SDK; `load_mcp_tools()` imports proxy/admin/mcp_tools.py, which does.
The error and its fix are `proxy.errors.McpNotInstalled` (mcp_tools.py says it too when run as a script).
"""

from __future__ import annotations

import logging
from types import ModuleType

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from proxy.admin.proxy_view import Extension, ProxyView
from proxy.errors import McpNotInstalled

log = logging.getLogger("hyperswap.mcp")


def load_mcp_tools() -> ModuleType:
    """proxy.admin.mcp_tools, or McpNotInstalled when the SDK is missing."""
    try:
        import proxy.admin.mcp_tools as tools
    except ImportError as exc:
        if not McpNotInstalled.caused(exc):
            raise
        raise McpNotInstalled() from None
    return tools


class McpMissing:
    """/mcp without the SDK: a 501 that names the extra, instead of a 404 or a proxy that does not start."""

    def __init__(self) -> None:
        self._told = False

    def routes(self) -> list[BaseRoute]:
        return [Route("/mcp", self._answer, methods=["GET", "POST", "DELETE"])]

    async def _answer(self, request: Request) -> JSONResponse:
        del request
        missing = McpNotInstalled()
        if not self._told:  # said when MCP is asked for, once: a proxy nobody asks for MCP says nothing
            self._told = True
            log.warning("MCP tools asked for at /mcp but off: %s (fix: %s)", missing.message, missing.fix)
        return JSONResponse(missing.body(), status_code=501)

    async def start(self) -> None:
        missing = McpNotInstalled()
        log.debug("MCP tools off: %s (fix: %s)", missing.message, missing.fix)

    async def stop(self) -> None:
        pass


def mcp_extension(proxy: ProxyView) -> Extension:
    """The MCP tools at /mcp, or the 501 that says how to install them."""
    try:
        tools = load_mcp_tools()
    except McpNotInstalled:
        return McpMissing()
    extension: Extension = tools.mcp_extension(proxy)
    return extension
