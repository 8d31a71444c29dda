"""The MCP tools, driven by the official SDK's client: over streamable HTTP at /mcp on the demo box's
admin listener, and over stdio against a subprocess `python -m proxy.admin.mcp_tools --admin URL`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from proxy.admin.mcp_tools import AdminClient, build_server
from proxy.config.units import GIB
from proxy.demo import Demo, run_prompt
from proxy.errors import McpNotInstalled
from tests.integration.boxes import LOOPBACK_TLS, DemoFactory, fast, free_port, port_open, process_tenant, proxy_of

TOOLS = {"health", "engines", "tenants", "plan", "release", "models", "start", "stop"}
REPO = Path(__file__).resolve().parents[2]
TOKEN = "mcp-test-token"


@asynccontextmanager
async def mcp_client(demo: Demo, token: str | None = None) -> AsyncIterator[Client]:
    url = proxy_of(demo).url("admin") + "/mcp"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(verify=LOOPBACK_TLS, headers=headers, timeout=30.0, trust_env=False) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            yield client


def text_of(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


async def test_http_lists_all_eight_tools_with_input_and_output_schemas(box: DemoFactory) -> None:
    demo = await box("default")
    async with mcp_client(demo) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS, sorted(tools)
    assert tools["plan"].input_schema["required"] == ["tenant"], tools["plan"].input_schema
    assert set(tools["plan"].input_schema["properties"]) == {"tenant", "need_gb"}
    assert tools["release"].input_schema["required"] == ["tenant"], tools["release"].input_schema
    assert all(t.output_schema for t in tools.values()), [n for n, t in tools.items() if not t.output_schema]
    release, listing = tools["release"].annotations, tools["tenants"].annotations
    assert release is not None and release.destructive_hint is True
    assert tools["start"].input_schema["required"] == tools["stop"].input_schema["required"] == ["tenant"]
    assert listing is not None and listing.read_only_hint is True


async def test_http_read_tools_return_structured_admin_answers(box: DemoFactory) -> None:
    demo = await box("default")
    async with mcp_client(demo) as client:
        health = await client.call_tool("health", {})
        engines = await client.call_tool("engines", {})
        tenants = await client.call_tool("tenants", {})
        plan = await client.call_tool("plan", {"tenant": "ollama", "need_gb": 4})
        missing = await client.call_tool("plan", {"tenant": "nosuch"})
    assert not health.is_error, text_of(health)
    assert {e["name"] for e in health.structured_content["entries"]} >= {"nvml", "upstream ollama"}
    assert not engines.is_error, text_of(engines)
    assert {e["tenant"] for e in engines.structured_content["engines"]} == {"ollama", "comfyui"}
    assert not tenants.is_error, text_of(tenants)
    assert {"ollama", "comfyui", "desktop"} <= {t["name"] for t in tenants.structured_content["tenants"]}
    assert not plan.is_error, text_of(plan)
    assert plan.structured_content["dry_run"] is True
    assert plan.structured_content["plan"]["need_bytes"] == 4 * GIB
    assert missing.is_error and "404" in text_of(missing), text_of(missing)


async def test_http_release_of_idle_comfyui_returns_the_freed_bytes(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    async with mcp_client(demo) as client:
        result = await client.call_tool("release", {"tenant": "comfyui"})
    assert not result.is_error, text_of(result)
    body = result.structured_content
    assert body["tenant"] == "comfyui" and body["confirmed"] is True, body
    assert body["freed_bytes"] > 1 * GIB, body
    assert [d.kind for d in proxy_of(demo).decisions.recent(5)][-1] == "release"


async def test_http_release_of_the_desktop_is_a_tool_error_with_the_409_reason(box: DemoFactory) -> None:
    demo = await box("default")
    async with mcp_client(demo) as client:
        result = await client.call_tool("release", {"tenant": "desktop"})
    assert result.is_error, result
    text = text_of(result)
    assert "409" in text and "not_reclaimable" in text and "Fix:" in text, text


async def test_http_start_and_stop_a_process_tenant_and_see_its_lifecycle(box: DemoFactory, tmp_path: Path) -> None:
    port = free_port()
    demo = await box(fast("default", tenants={"app": process_tenant(port, tmp_path)}))
    async with mcp_client(demo) as client:
        started = await client.call_tool("start", {"tenant": "app"})
        listed = await client.call_tool("tenants", {})
        stopped = await client.call_tool("stop", {"tenant": "app"})
        refused = await client.call_tool("stop", {"tenant": "ollama"})
    assert not started.is_error, text_of(started)
    assert started.structured_content["lifecycle"]["state"] == "running", started.structured_content
    lifecycles = {t["name"]: t["lifecycle"] for t in listed.structured_content["tenants"]}
    assert lifecycles["app"]["state"] == "running" and lifecycles["ollama"] is None, lifecycles
    assert not stopped.is_error and stopped.structured_content["lifecycle"]["state"] == "stopped", text_of(stopped)
    assert not port_open(port)
    assert refused.is_error and "409" in text_of(refused) and "not_lifecycle" in text_of(refused), text_of(refused)


async def test_http_with_admin_token_refuses_calls_without_it(box: DemoFactory, http: httpx.AsyncClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", TOKEN)
    demo = await box("default")
    url = proxy_of(demo).url("admin") + "/mcp"
    bare = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                           headers={"Accept": "application/json, text/event-stream"})
    assert bare.status_code == 401 and "fix" in bare.json(), bare.text
    wrong = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                            headers={"Authorization": "Bearer nope", "Accept": "application/json, text/event-stream"})
    assert wrong.status_code == 403, wrong.text
    with pytest.raises(ExceptionGroup) as refused:
        async with mcp_client(demo) as client:
            await client.list_tools()
    assert refused.group_contains(MCPError), refused.value  # the SDK's client surfaces the 401 as an MCP error
    async with mcp_client(demo, TOKEN) as client:
        result = await client.call_tool("release", {"tenant": "desktop"})
    # Past the gate, the admin API itself answered (409), so the token reached it.
    assert result.is_error and "409" in text_of(result), text_of(result)


async def test_stdio_server_lists_tools_and_reads_tenants_of_a_running_proxy(box: DemoFactory) -> None:
    demo = await box("default")
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "proxy.admin.mcp_tools", "--admin", proxy_of(demo).url("admin")],
                                   cwd=str(REPO), env={"NO_PROXY": "127.0.0.1,localhost"})
    async with Client(params) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        tenants = await client.call_tool("tenants", {})
    assert tools == TOOLS, sorted(tools)
    assert not tenants.is_error, text_of(tenants)
    assert "comfyui" in {t["name"] for t in tenants.structured_content["tenants"]}


async def test_the_tools_say_so_when_no_proxy_answers() -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused at once. The server is
    # the one `hyperswap mcp` builds, here in-process: the stdio transport is the test above's.
    server = build_server(AdminClient(lambda: "http://127.0.0.1:1", lambda: None))
    async with Client(server) as client:
        result = await client.call_tool("tenants", {})
    assert result.is_error and "cannot reach" in text_of(result) and "hyperswap serve" in text_of(result), text_of(result)


async def test_the_models_tool_lists_model_files_with_residency(box: DemoFactory) -> None:
    demo = await box("default")
    async with mcp_client(demo) as client:
        result = await client.call_tool("models", {"tenant": "ollama"})
    assert not result.is_error, text_of(result)
    (ollama,) = result.structured_content["tenants"]
    gemma = next(m for m in ollama["models"] if m["name"] == "gemma3:27b")
    assert gemma["size_gb"] == 16.2 and "resident_percent" in gemma["residency"]


# -- without the optional SDK (the `mcp` extra) -------------------------------------------------------

def hide_mcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the [mcp] extra were not installed: None in sys.modules for the SDK and each module of it."""
    for name in [n for n in sys.modules if n == "mcp" or n.startswith("mcp.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mcp", None)
    monkeypatch.delitem(sys.modules, "proxy.admin.mcp_tools", raising=False)


async def test_without_the_sdk_the_proxy_runs_and_its_mcp_route_answers_501_with_the_fix(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_mcp(monkeypatch)
    demo = await box("default")
    url = proxy_of(demo).url("admin")
    r = await http.post(url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                        headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 501, r.text
    assert r.json() == {"error": "the MCP tools need the optional mcp package, which is not installed",
                        "fix": McpNotInstalled().fix}, r.text
    assert (await http.get(url + "/api/tenants")).status_code == 200  # the rest of the admin API is there


def test_python_m_mcp_tools_without_the_sdk_says_how_to_install_it_and_exits_2() -> None:
    code = "import runpy, sys; sys.modules['mcp'] = None; runpy.run_module('proxy.admin.mcp_tools', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", code, "--admin", "http://127.0.0.1:1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr == ("error: the MCP tools need the optional mcp package, which is not "
                                                 f"installed (fix: {McpNotInstalled().fix})\n"), done.stderr
