"""The engine adapter base: what a request needs (GPU or not) and how headers cross the proxy.

One adapter instance per tenant. Subclasses override only what differs per engine; later methods
(release, OOM reading, estimates) are added beside these without changing the request side.
"""

from __future__ import annotations

from typing import Iterable, Literal, Sequence
from urllib.parse import urlsplit

from ..tenants import Tenant

RequestKind = Literal["gpu", "passthrough"]
Header = tuple[str, str]

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# The websocket client library writes its own handshake; the client's would be wrong upstream.
WS_HANDSHAKE = frozenset({
    "host", "origin", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
    "sec-websocket-protocol", "sec-websocket-accept", "user-agent",
})
FORWARDED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"})


def strip_hop_by_hop(headers: Iterable[Header]) -> list[Header]:
    """Drop hop-by-hop headers, including any the Connection header names."""
    items = list(headers)
    named = {token.strip().lower() for k, v in items if k.lower() == "connection" for token in v.split(",")}
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP and k.lower() not in named
            and not k.lower().startswith("proxy-")]


def _origin_netloc(origin: str) -> str | None:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    host = parts.netloc.lower()
    default = ":443" if parts.scheme == "https" else ":80"
    return host.removesuffix(default)


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """True when a browser's Origin names the address it opened (the client-facing Host)."""
    netloc = _origin_netloc(origin)
    if netloc is None:
        return False
    default = ":443" if scheme in ("https", "wss") else ":80"
    return netloc == host.lower().removesuffix(default)


class EngineAdapter:
    """Generic engine: every POST/PUT may load something onto the GPU; the rest passes through."""

    kind: str = "generic"

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        upstream = urlsplit(tenant.upstream or "http://127.0.0.1")
        self.upstream_scheme = upstream.scheme
        self.upstream_host = upstream.netloc  # what the engine believes its own Host is
        self.upstream_origin = f"{upstream.scheme}://{upstream.netloc}"

    # -- classification -------------------------------------------------------------------
    def classify(self, method: str, path: str) -> RequestKind:
        return "gpu" if method.upper() in ("POST", "PUT") else "passthrough"

    # -- headers --------------------------------------------------------------------------
    def upstream_headers(self, headers: Sequence[Header], *, client_ip: str | None, scheme: str,
                         websocket: bool = False) -> list[Header]:
        """The request headers to send upstream: hop-by-hop stripped, Host/Origin per engine,
        X-Forwarded-* appended. `scheme` is the client-facing one (http, https, ws, wss)."""
        client_host = next((v for k, v in headers if k.lower() == "host"), "")
        out: list[Header] = []
        for name, value in strip_hop_by_hop(headers):
            low = name.lower()
            if low == "host" or low in FORWARDED or (websocket and low in WS_HANDSHAKE and low != "origin"):
                continue
            if low == "origin":
                value = self.rewrite_origin(value, client_host, scheme)
            out.append((name, value))
        out.insert(0, ("host", self.upstream_host))
        prior = [v for k, v in headers if k.lower() == "x-forwarded-for"]
        if client_ip:
            out.append(("x-forwarded-for", ", ".join(prior + [client_ip])))
        elif prior:
            out.append(("x-forwarded-for", ", ".join(prior)))
        out.append(("x-forwarded-proto", "https" if scheme in ("https", "wss") else "http"))
        if client_host:
            out.append(("x-forwarded-host", client_host))
        return out

    def rewrite_origin(self, origin: str, client_host: str, scheme: str) -> str:
        """Same-origin rule, shared by every engine that checks Origin against Host.

        The upstream sees Host = its own address. A browser that opened the proxy's address sends
        Origin = that address; it is the same origin seen through the proxy, so it is rewritten to the
        upstream's origin and the engine's Host/Origin check passes as it would have directly. Any
        other Origin (a different site, a different port) is forwarded untouched, so the engine keeps
        rejecting cross-origin requests exactly as it would without the proxy: the proxy must not
        launder a foreign page's request into a same-origin one (a CSRF hole).
        """
        if client_host and same_origin(origin, client_host, scheme):
            return self.upstream_origin
        return origin

    # -- jobs (engines whose work outlives the HTTP response) -------------------------------
    def captures_job(self, method: str, path: str) -> bool:
        """Whether the response to this request names a job that stays busy after it ends."""
        return False

    def job_id_from_response(self, status: int, body: bytes) -> str | None:
        return None

    def job_done_from_frame(self, text: str) -> str | None:
        """The job id a websocket text frame says is finished, if any."""
        return None

    def history_path(self, job_id: str) -> str | None:
        """Where to poll for a job's end when no websocket reports it (None: not pollable)."""
        return None

    def job_done_from_history(self, job_id: str, status: int, body: bytes) -> bool:
        return False
