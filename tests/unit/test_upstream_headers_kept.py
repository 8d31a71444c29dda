"""The headers a replayed request sends upstream are remembered per client header set (a client sends
the same ones with every request but the length): what goes upstream must be exactly what the
adapter builds afresh, whatever the length, the client's address, the scheme or a reload."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config.schema import EngineKind, Tenant
from proxy.engines.ports import Header
from proxy.relay import forward
from proxy.relay.forward import Forwarder


def tenant(engine: EngineKind = "ollama", upstream: str = "http://127.0.0.1:11434") -> Tenant:
    return Tenant(name="t", engine=engine, upstream=upstream)


def scope(headers: list[Header], *, method: str = "POST", client: str = "127.0.0.1", scheme: str = "http") -> Any:
    return {"type": "http", "method": method, "path": "/api/generate", "raw_path": b"/api/generate",
            "query_string": b"", "scheme": scheme, "client": (client, 50000), "headers": headers}


def afresh(f: Forwarder, t: Tenant, s: Any, body: bytes) -> list[Header]:
    """What went upstream before the headers were remembered: the adapter's, Content-Length re-done."""
    headers = f.adapter(t).upstream_headers(s["headers"], client_ip=s["client"][0], scheme=s["scheme"])
    headers = [(k, v) for k, v in headers if k != b"content-length"]
    if body or s["method"] not in ("GET", "HEAD"):
        headers.append((b"content-length", b"%d" % len(body)))
    return headers


HEADER_SETS = [
    [(b"host", b"127.0.0.1:8080"), (b"content-length", b"37"), (b"content-type", b"application/json")],
    [(b"host", b"localhost:8080"), (b"origin", b"http://localhost:8080"), (b"content-length", b"5"),
     (b"x-forwarded-for", b"10.0.0.9"), (b"connection", b"keep-alive, x-drop"), (b"x-drop", b"1")],
    [(b"content-length", b"0"), (b"host", b"127.0.0.1:8080"), (b"origin", b"http://elsewhere.example")],
    [(b"host", b"127.0.0.1:8080"), (b"connection", b"content-length"), (b"content-length", b"3")],
    [],
]


@pytest.mark.parametrize("headers", HEADER_SETS)
@pytest.mark.parametrize("body", [b"", b"{}", b'{"model": "m", "prompt": "a longer prompt"}'])
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_the_upstream_headers_are_the_adapters_own_on_every_request(headers: list[Header], body: bytes,
                                                                    method: str) -> None:
    f, t = Forwarder(), tenant()
    for client, scheme in [("127.0.0.1", "http"), ("127.0.0.1", "http"), ("10.1.2.3", "https"), ("127.0.0.1", "http")]:
        s = scope(headers, method=method, client=client, scheme=scheme)
        _, _, sent, _ = f._upstream_request(t, s, body)
        assert sent == afresh(f, t, s, body), f"{client} {scheme}: {sent}"


def test_a_length_that_changes_is_the_bodys_own_each_time() -> None:
    f, t = Forwarder(), tenant()
    for n in (1, 200, 7):
        body = b"x" * n
        _, _, sent, _ = f._upstream_request(t, scope([(b"host", b"h:1"), (b"content-length", b"%d" % n)]), body)
        assert sent.count((b"content-length", b"%d" % n)) == 1 and len([k for k, _ in sent if k == b"content-length"]) == 1


def test_a_reloaded_tenant_gets_its_new_adapters_headers() -> None:
    f = Forwarder()
    s = scope([(b"host", b"127.0.0.1:8080"), (b"content-length", b"2")])
    _, _, before, _ = f._upstream_request(tenant(upstream="http://127.0.0.1:11434"), s, b"{}")
    assert (b"host", b"127.0.0.1:11434") in before
    moved = tenant(upstream="http://127.0.0.1:11999")
    _, _, after, _ = f._upstream_request(moved, s, b"{}")
    assert (b"host", b"127.0.0.1:11999") in after and (b"host", b"127.0.0.1:11434") not in after


def test_the_kept_headers_are_bounded_and_a_caller_may_change_its_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forward, "UNFRAMED_KEPT_MAX", 3)
    f, t = Forwarder(), tenant()
    for i in range(10):
        f._upstream_request(t, scope([(b"host", b"h:1"), (b"x-n", b"%d" % i)]), b"{}")
    assert len(f._unframed) <= 3
    s = scope([(b"host", b"h:1")])
    _, _, first, _ = f._upstream_request(t, s, b"{}")
    first.append((b"x-mine", b"1"))
    _, _, second, _ = f._upstream_request(t, s, b"{}")
    assert (b"x-mine", b"1") not in second
