"""DNS rebinding and cross-site requests, through real listeners on port 0 in front of the simulators.

A rebinding page is served as attacker.example:PORT and its name then points at 127.0.0.1: the
browser sends `Host: attacker.example:PORT` and, for a POST, `Origin: http://attacker.example:PORT`
(same-origin as far as the browser knows). The tenant listeners refuse such a Host before anything
reaches the engine; the admin API refuses it with 421 and refuses cross-origin or form mutations.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx

from proxy.demo import Demo
from tests.integration.boxes import DemoFactory, fast, ollama_of, proxy_of

ATTACK_HOST = "attacker.example:11435"
ATTACK = {"Host": ATTACK_HOST, "Origin": f"http://{ATTACK_HOST}", "Content-Type": "text/plain"}
UNLOAD = b'{"model":"llama3.2:3b","keep_alive":0}'
SAFETY_S = 10.0


async def _loaded(demo: Demo, http: httpx.AsyncClient) -> dict[str, int]:
    assert demo.box.ollama is not None
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    return ollama_of(demo).loaded()


def _refusal(r: httpx.Response, status: int) -> dict[str, str]:
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body: dict[str, str] = r.json()
    assert body["error"] and body["fix"], body
    return body


async def _ws_handshake(url: str, host: str, origin: str) -> tuple[int, bytes]:
    """A websocket handshake with a chosen Host (client libraries write their own): status, body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write((f"GET /ws?clientId=rebind HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\n"
                      "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), SAFETY_S) if status != 101 and length else b""
        return status, body
    finally:
        writer.close()


# -- tenant listeners ------------------------------------------------------------------------------------

async def test_rebinding_page_cannot_unload_a_model_through_the_ollama_drop_in(box: DemoFactory, http: httpx.AsyncClient) -> None:
    # The attack of issue 13, byte for byte: Host and Origin name the attacker's page, a CORS-simple body.
    demo = await box("default")
    assert "llama3.2:3b" in await _loaded(demo, http)
    direct = await http.post(demo.box.servers["ollama"].url + "/api/generate", headers=ATTACK, content=UNLOAD)
    assert (direct.status_code, direct.content) == (403, b""), "Ollama itself refuses this Host"
    through = await http.post(proxy_of(demo).url("ollama") + "/api/generate", headers=ATTACK, content=UNLOAD)
    body = _refusal(through, 403)
    assert body["tenant"] == "ollama" and ATTACK_HOST in body["error"], body
    assert 'add "attacker.example" to tenants.ollama.allowed_hosts' in body["fix"], body
    assert "llama3.2:3b" in ollama_of(demo).loaded(), "the model was unloaded through the proxy"


async def test_rebinding_page_cannot_list_copy_or_delete_models(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    o = proxy_of(demo).url("ollama")
    reads = await http.get(o + "/api/tags", headers={"Host": ATTACK_HOST})
    copy = await http.post(o + "/api/copy", headers=ATTACK, content=b'{"source":"llama3.2:3b","destination":"x"}')
    delete = await http.request("DELETE", o + "/api/delete", headers=ATTACK, content=b'{"model":"llama3.2:3b"}')
    for r in (reads, copy, delete):
        _refusal(r, 403)
    assert demo.box.ollama is not None and ollama_of(demo).requests.get("/api/copy", 0) == 0
    assert ollama_of(demo).requests.get("/api/delete", 0) == 0, "nothing may reach the engine"


async def test_local_names_ollama_accepts_pass_through_the_drop_in(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    port = proxy_of(demo).servers["ollama"].port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"studio.localhost:{port}", f"gpu-box.local:{port}",
                 f"192.168.1.5:{port}", f"[::1]:{port}"):
        r = await http.get(proxy_of(demo).url("ollama") + "/api/version", headers={"Host": host})
        assert r.status_code == 200, f"Ollama allows {host}, so must the drop-in: {r.status_code} {r.text}"


async def test_same_origin_page_works_and_foreign_origin_is_left_for_ollama_to_refuse(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    o = proxy_of(demo).url("ollama")
    own = urlsplit(o).netloc
    same = await http.post(o + "/api/show", headers={"Origin": f"http://{own}"}, json={"model": "llama3.2:3b"})
    assert same.status_code == 200, f"a page opened on the proxy is same-origin for Ollama: {same.text}"
    foreign = await http.post(o + "/api/show", headers={"Origin": "http://evil.example"}, json={"model": "llama3.2:3b"})
    assert (foreign.status_code, foreign.content) == (403, b""), "a foreign Origin must reach Ollama untouched (its CORS 403)"


async def test_ollama_origins_of_the_engine_still_decide_for_a_foreign_origin(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", ollama={"origins": ["http://notebook.example"]}))
    r = await http.post(proxy_of(demo).url("ollama") + "/api/show", headers={"Origin": "http://notebook.example"},
                        json={"model": "llama3.2:3b"})
    assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == "http://notebook.example", r.text


async def test_allowed_hosts_lets_a_configured_name_reach_ollama(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", tenants={"ollama": {"allowed_hosts": ["llm.example.com"]}}))
    r = await http.get(proxy_of(demo).url("ollama") + "/api/tags", headers={"Host": "llm.example.com:11435"})
    assert r.status_code == 200, r.text
    other = await http.get(proxy_of(demo).url("ollama") + "/api/tags", headers={"Host": ATTACK_HOST})
    _refusal(other, 403)


async def test_rebinding_page_cannot_reach_comfyui_although_comfyui_would_answer_it(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # ComfyUI compares Origin with Host only for a loopback Host: a rebinding page passes it directly.
    demo = await box("default")
    host = "attacker.example:8189"
    headers = {"Host": host, "Origin": f"http://{host}"}
    direct = await http.get(demo.box.servers["comfyui"].url + "/queue", headers=headers)
    assert direct.status_code == 200, "the simulator mimics ComfyUI, which does not stop rebinding"
    through = await http.get(proxy_of(demo).url("comfyui") + "/queue", headers=headers)
    assert _refusal(through, 403)["tenant"] == "comfyui"


async def test_rebinding_page_cannot_open_the_comfyui_websocket(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    host = "attacker.example:8189"
    direct, _ = await _ws_handshake(demo.box.servers["comfyui"].url, host, f"http://{host}")
    assert direct == 101, "ComfyUI itself accepts the rebinding handshake"
    status, body = await _ws_handshake(proxy_of(demo).url("comfyui"), host, f"http://{host}")
    assert status == 403, f"the handshake must be refused, got {status}"
    assert b'"tenant":"comfyui"' in body and b"allowed_hosts" in body, body
    own = urlsplit(proxy_of(demo).url("comfyui")).netloc
    ok, _ = await _ws_handshake(proxy_of(demo).url("comfyui"), own, f"http://{own}")
    assert ok == 101, "the proxy's own address keeps its websocket"


async def test_several_host_headers_are_refused(box: DemoFactory) -> None:
    demo = await box("default")
    parts = urlsplit(proxy_of(demo).url("ollama"))
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nHost: attacker.example\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), SAFETY_S)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    assert b"models" not in answer, "an ambiguous Host must not reach the engine"


# -- admin API -------------------------------------------------------------------------------------------

async def test_rebinding_page_cannot_read_admin_stats(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    a = proxy_of(demo).url("admin")
    r = await http.get(a + "/api/stats", headers={"Host": "attacker.example:11400"})
    body = _refusal(r, 421)
    assert "cmdline" not in r.text and "admin.allowed_hosts" in body["fix"], body
    for host in (urlsplit(a).netloc, f"localhost:{proxy_of(demo).servers['admin'].port}"):
        assert (await http.get(a + "/api/stats", headers={"Host": host})).status_code == 200, host


async def test_admin_host_check_covers_dashboard_events_and_mcp(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    a = proxy_of(demo).url("admin")
    for path in ("/", "/api/events", "/metrics", "/openapi.json"):
        _refusal(await http.get(a + path, headers={"Host": "attacker.example"}), 421)
    mcp = await http.post(a + "/mcp", headers={"Host": "attacker.example", "Accept": "application/json, text/event-stream"},
                          json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    _refusal(mcp, 421)
    assert (await http.get(a + "/")).status_code == 200, "the dashboard on the admin's own address"


async def test_cross_site_form_cannot_release_a_tenant(box: DemoFactory, http: httpx.AsyncClient) -> None:
    # A plain <form method=post> on any page: no preflight, Origin names that page.
    demo = await box("default")
    assert "llama3.2:3b" in await _loaded(demo, http)
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/ollama/release",
                        headers={"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
                        content=b"x=1")
    body = _refusal(r, 403)
    assert "evil.example" in body["error"] and "admin.cors_origins" in body["fix"], body
    assert "llama3.2:3b" in ollama_of(demo).loaded(), "the form unloaded the model"


async def test_origin_null_cannot_release(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/ollama/release", headers={"Origin": "null"})
    _refusal(r, 403)


async def test_mutation_with_a_non_json_body_gets_415(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    url = proxy_of(demo).url("admin") + "/api/tenants/ollama/release"
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
        body = _refusal(await http.post(url, headers={"Content-Type": ctype}, content=b"x=1"), 415)
        assert "application/json" in body["fix"], body
    _refusal(await http.post(url, content=b"x=1"), 415)  # a body without a Content-Type


async def test_same_origin_dashboard_release_and_plain_clients_still_work(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    a = proxy_of(demo).url("admin")
    url = a + "/api/tenants/ollama/release"
    dashboard = await http.post(url, headers={"Origin": a})  # the dashboard's fetch: same origin, no body
    assert dashboard.status_code == 200, dashboard.text
    assert (await http.post(url)).status_code == 200, "curl -X POST (no Origin, no body)"
    assert (await http.post(url, json={})).status_code == 200, "a JSON body"
    port = proxy_of(demo).servers["admin"].port
    assert (await http.post(url, headers={"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"})).status_code == 200


async def test_configured_cors_origin_may_release(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", settings={"admin": {"cors_origins": ["http://dash.local"]}}))
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/ollama/release", headers={"Origin": "http://dash.local"})
    assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == "http://dash.local", r.text


async def test_admin_allowed_hosts_lets_a_configured_name_read(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", settings={"admin": {"allowed_hosts": ["hyperswap.lan"]}}))
    r = await http.get(proxy_of(demo).url("admin") + "/api/tenants", headers={"Host": "hyperswap.lan:11400"})
    assert r.status_code == 200, r.text
