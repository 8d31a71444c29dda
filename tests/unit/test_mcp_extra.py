"""Without the optional mcp SDK (the `mcp` extra) the proxy runs, /mcp answers 501 with
the fix, and `hyperswap mcp` says how to install it in one line and exits 2. The SDK is hidden by
putting None in sys.modules for it and every module of it, as an uninstalled package would look."""

from __future__ import annotations

import sys
from typing import cast

import httpx
import pytest
from starlette.applications import Starlette

from proxy.admin.mcp_extra import McpMissing, load_mcp_tools, mcp_extension
from proxy.admin.proxy_view import ProxyView
from proxy.cli import main
from proxy.errors import McpNotInstalled

FIX = ("pip install 'mcp>=2.3,<3' into the proxy's environment (or install the checkout with its mcp extra: "
       "pip install '.[mcp]'); no package index has hyperswap itself")


@pytest.fixture
def no_mcp(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "mcp" or n.startswith("mcp.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mcp", None)
    monkeypatch.delitem(sys.modules, "proxy.admin.mcp_tools", raising=False)


def test_hyperswap_mcp_without_the_extra_says_how_to_install_it_and_exits_2(
        no_mcp: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--admin", "http://127.0.0.1:1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: the MCP tools need the optional mcp package") and FIX in err, err


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
async def test_the_mcp_route_without_the_extra_answers_501_with_error_and_fix(no_mcp: None, method: str) -> None:
    extension = mcp_extension(cast(ProxyView, object()))  # the missing SDK is found before the proxy is touched
    assert isinstance(extension, McpMissing)
    await extension.start()
    app = Starlette(routes=extension.routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
        r = await client.request(method, "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    await extension.stop()
    assert r.status_code == 501, r.text
    body = r.json()
    assert set(body) == {"error", "fix"} and "mcp" in body["error"] and body["fix"] == FIX, body


def test_with_the_sdk_installed_the_real_tools_load() -> None:
    assert load_mcp_tools().__name__ == "proxy.admin.mcp_tools"


def test_only_a_missing_mcp_module_is_taken_for_the_missing_extra() -> None:
    assert McpNotInstalled.caused(ModuleNotFoundError("x", name="mcp"))
    assert McpNotInstalled.caused(ModuleNotFoundError("x", name="mcp.server.mcpserver"))
    # anything else broken under the tools is a bug to show, not an extra to suggest
    assert not McpNotInstalled.caused(ModuleNotFoundError("x", name="mcpx"))
    assert not McpNotInstalled.caused(ModuleNotFoundError("x", name="httpx"))
    assert not McpNotInstalled.caused(ImportError("cannot import name 'MCPServer'"))


async def test_without_the_extra_nothing_is_said_until_mcp_is_asked_for_then_once(
        no_mcp: None, caplog: pytest.LogCaptureFixture) -> None:
    extension = mcp_extension(cast(ProxyView, object()))
    caplog.set_level("INFO", logger="hyperswap.mcp")
    await extension.start()
    assert not caplog.records, f"a proxy nobody asked for MCP warned at start: {caplog.messages}"
    app = Starlette(routes=extension.routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
        for _ in range(3):
            await client.post("/mcp", json={})
    await extension.stop()
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and FIX in said[0].getMessage(), caplog.messages
