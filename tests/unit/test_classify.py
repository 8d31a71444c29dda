"""Engine adapters' request side: classification, header rules, ComfyUI job markers."""

from __future__ import annotations

import json

import pytest

from proxy.config.schema import EngineKind, Tenant
from proxy.engines import ComfyUIAdapter, GenericAdapter, OllamaAdapter, adapter_for, strip_hop_by_hop


def tenant(engine: EngineKind, upstream: str = "http://127.0.0.1:11434") -> Tenant:
    return Tenant(name=engine, engine=engine, upstream=upstream)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
                                  "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                  "/v1/responses", "/v1/messages"])
def test_ollama_model_routes_need_the_gpu(path: str) -> None:
    assert OllamaAdapter(tenant("ollama")).classify("POST", path) == "gpu"


@pytest.mark.parametrize("method,path", [("POST", "/api/pull"), ("GET", "/api/tags"), ("GET", "/api/ps"),
                                         ("GET", "/api/generate"), ("DELETE", "/api/delete"),
                                         ("POST", "/api/show"), ("GET", "/"), ("GET", "/v1/models")])
def test_ollama_other_routes_pass_through(method: str, path: str) -> None:
    assert OllamaAdapter(tenant("ollama")).classify(method, path) == "passthrough"


@pytest.mark.parametrize("method,path,kind", [("POST", "/prompt", "gpu"), ("POST", "/api/prompt", "gpu"),
                                              ("GET", "/prompt", "passthrough"), ("POST", "/free", "passthrough"),
                                              ("POST", "/upload/image", "passthrough"), ("GET", "/ws", "passthrough")])
def test_comfyui_only_prompt_posts_need_the_gpu(method: str, path: str, kind: str) -> None:
    assert ComfyUIAdapter(tenant("comfyui")).classify(method, path) == kind


def test_generic_posts_and_puts_need_the_gpu() -> None:
    a = GenericAdapter(tenant("generic"))
    assert [a.classify(m, "/x") for m in ("POST", "PUT", "GET", "DELETE")] == ["gpu", "gpu", "passthrough", "passthrough"]


def test_adapter_for_picks_by_engine_kind() -> None:
    assert type(adapter_for(tenant("ollama"))) is OllamaAdapter
    assert type(adapter_for(tenant("comfyui"))) is ComfyUIAdapter
    assert type(adapter_for(tenant("generic"))) is GenericAdapter


def test_hop_by_hop_headers_and_those_named_in_connection_are_stripped() -> None:
    headers = [("Connection", "keep-alive, X-Secret"), ("Keep-Alive", "timeout=5"), ("TE", "trailers"),
               ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"), ("Proxy-Authorization", "x"),
               ("Trailer", "x"), ("X-Secret", "1"), ("Content-Type", "application/json")]
    assert strip_hop_by_hop(_b(headers)) == [(b"content-type", b"application/json")]


def _b(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """As an ASGI server hands them over: names lower-cased."""
    return [(k.lower().encode(), v.encode()) for k, v in headers]


def _h(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode().lower(): v.decode() for k, v in headers}


def test_ollama_upstream_gets_its_own_host_and_forwarded_headers() -> None:
    a = OllamaAdapter(tenant("ollama"))
    out = _h(a.upstream_headers(_b([("Host", "llm.example.com"), ("X-Forwarded-For", "10.0.0.1")]),
                                client_ip="10.0.0.2", scheme="https"))
    assert out["host"] == "127.0.0.1:11434"
    assert out["x-forwarded-for"] == "10.0.0.1, 10.0.0.2"
    assert out["x-forwarded-proto"] == "https"
    assert out["x-forwarded-host"] == "llm.example.com"


def test_same_origin_browser_request_is_rewritten_to_the_upstream_origin() -> None:
    a = ComfyUIAdapter(tenant("comfyui", "http://127.0.0.1:8188"))
    out = _h(a.upstream_headers(_b([("Host", "127.0.0.1:8189"), ("Origin", "http://127.0.0.1:8189")]),
                                client_ip="127.0.0.1", scheme="http"))
    assert (out["host"], out["origin"]) == ("127.0.0.1:8188", "http://127.0.0.1:8188")


def test_same_origin_ignores_default_ports() -> None:
    a = ComfyUIAdapter(tenant("comfyui", "http://127.0.0.1:8188"))
    out = _h(a.upstream_headers(_b([("Host", "gpu.example.com"), ("Origin", "https://gpu.example.com")]),
                                client_ip=None, scheme="https"))
    assert out["origin"] == "http://127.0.0.1:8188"


@pytest.mark.parametrize("origin", ["http://evil.example", "http://127.0.0.1:3000", "null"])
def test_cross_origin_request_keeps_its_origin_so_the_engine_still_refuses(origin: str) -> None:
    a = ComfyUIAdapter(tenant("comfyui", "http://127.0.0.1:8188"))
    out = _h(a.upstream_headers(_b([("Host", "127.0.0.1:8189"), ("Origin", origin)]), client_ip=None, scheme="http"))
    assert out["origin"] == origin and out["host"] == "127.0.0.1:8188"


def test_websocket_handshake_headers_are_left_to_the_client_library() -> None:
    a = ComfyUIAdapter(tenant("comfyui", "http://127.0.0.1:8188"))
    out = _h(a.upstream_headers(_b([("Host", "h:1"), ("Sec-WebSocket-Key", "k"), ("Sec-WebSocket-Version", "13"),
                                 ("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Cookie", "c=1")]),
                                client_ip=None, scheme="ws", websocket=True))
    assert "sec-websocket-key" not in out and "upgrade" not in out and out["cookie"] == "c=1"


def test_comfyui_reads_prompt_id_from_prompt_answer() -> None:
    a = ComfyUIAdapter(tenant("comfyui"))
    assert a.job_id_from_response(200, b'{"prompt_id": "p1", "number": 0, "node_errors": {}}') == "p1"
    assert a.job_id_from_response(400, b'{"error": {"type": "no_prompt"}}') is None
    assert a.job_id_from_response(200, b"500 Internal Server Error") is None


def test_comfyui_end_marker_is_executing_with_null_node() -> None:
    a = ComfyUIAdapter(tenant("comfyui"))
    end = json.dumps({"type": "executing", "data": {"node": None, "prompt_id": "p1"}})
    running = json.dumps({"type": "executing", "data": {"node": "3", "display_node": "3", "prompt_id": "p1"}})
    status = json.dumps({"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}})
    assert [a.job_done_from_frame(f) for f in (end, running, status, "executing{")] == ["p1", None, None, None]


def test_comfyui_history_shows_done_only_once_listed() -> None:
    a = ComfyUIAdapter(tenant("comfyui"))
    assert a.history_path("p1") == "/history/p1"
    assert a.job_done_from_history("p1", 200, b"{}") is False
    assert a.job_done_from_history("p1", 200, b'{"p1": {"status": {"completed": true}}}') is True


@pytest.mark.parametrize("method, path, news", [
    ("POST", "/queue", True), ("POST", "/api/queue/", True),  # a delete or clear
    ("GET", "/history/p1", True), ("GET", "/api/history", True), ("GET", "/queue", True),  # a client waiting for its end
    ("GET", "/system_stats", False), ("POST", "/prompt", False), ("GET", "/historyx", False),
    ("DELETE", "/history", False),
])
def test_comfyui_job_news_is_a_queue_change_or_a_client_polling_for_its_end(method: str, path: str,
                                                                           news: bool) -> None:
    assert adapter_for(tenant("comfyui", "http://127.0.0.1:8188")).job_news(method, path) is news
    assert adapter_for(tenant("ollama")).job_news(method, path) is False
