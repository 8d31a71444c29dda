"""The GPU gate reads a request's path from its scope, not from a URL it builds (a parse of the whole
address per request): it must read exactly what Starlette's `request.url.path` reads, for any path,
since the path names the request in its decision and picks the adapter's answers."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from proxy.relay.gpu_gate import request_path

PROPERTY = settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the characters urlsplit treats specially, among ordinary ones and any other text
PATHS = st.one_of(
    st.lists(st.sampled_from(["/", "a", "api", "generate", "?", "#", "\\", " ", "\t", "\r", "\n", "\x00", "\x1f", "%",
                              "[", "]", "@", ":", "\xa0", "é", ";"]), max_size=12).map("".join),
    st.text(max_size=24),
    st.text(max_size=24).map(lambda s: "/" + s),
)


def _scope(path: str, query: bytes) -> dict[str, object]:
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode("utf-8", "replace"),
            "query_string": query, "scheme": "http", "server": ("127.0.0.1", 11434), "root_path": "",
            "headers": [(b"host", b"127.0.0.1:11434")]}


@PROPERTY
@given(path=PATHS, query=st.sampled_from([b"", b"a=1", b"x= "]))
def test_the_path_the_gate_reads_is_starlettes_url_path(path: str, query: bytes) -> None:
    request = Request(_scope(path, query))
    assert request_path(request) == request.url.path, f"{path!r} (query {query!r})"


def test_an_ordinary_path_is_the_scopes_own_string() -> None:
    request = Request(_scope("/api/generate", b""))
    assert request_path(request) == "/api/generate"
    assert not hasattr(request, "_url"), "no URL was built for an ordinary path"
