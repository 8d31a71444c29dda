"""The engine adapter base: what a request needs (GPU or not) and how headers cross the proxy.

One adapter instance per tenant. Subclasses override only what differs per engine; later methods
(release, OOM reading, estimates) are added beside these without changing the request side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal
from urllib.parse import urlsplit

from proxy.relay.hosts import HostPolicy, listener_policy
from proxy.tenants import Tenant

RequestKind = Literal["gpu", "passthrough"]
# Raw bytes as ASGI and the wire carry them (latin-1); no decode/encode per request on the relay path.
Header = tuple[bytes, bytes]

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# The websocket client library writes its own handshake; the client's would be wrong upstream.
WS_HANDSHAKE = frozenset({
    b"host", b"origin", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept", b"user-agent",
})
FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host"})


def strip_hop_by_hop(headers: Sequence[Header]) -> list[Header]:
    """Drop hop-by-hop headers, including any the Connection header names.

    Names must be lower-case, as ASGI servers and `http1` hand them over (HTTP names are case-insensitive)."""
    out = [(k, v) for k, v in headers if k not in HOP_BY_HOP and not k.startswith(b"proxy-")]
    if len(out) != len(headers):  # something was dropped: maybe a Connection header naming more
        named = {token.strip().lower() for k, v in headers if k == b"connection" for token in v.split(b",")}
        if named:
            out = [(k, v) for k, v in out if k not in named]
    return out


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
    # Whether the engine's HTTP answer itself can say the GPU ran out of memory (then the request is
    # retried once); an engine whose jobs outlive the answer reports it later, on a frame or in history.
    answers_oom: bool = False
    # The command-line flag that picks the engine's GPU on a host with several (proxy/gpu/devices.py);
    # None: the engine has none, and only CUDA_VISIBLE_DEVICES in its environment says.
    device_flag: str | None = None
    # How its model files are laid out on disk (proxy/models/locate.py): "ollama" (manifests and
    # blobs), "comfyui" (model folders), or None (only the tenant's model_paths say).
    model_layout: str | None = None

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        upstream = urlsplit(tenant.upstream or "http://127.0.0.1")
        self.upstream_scheme = upstream.scheme
        self.upstream_host = upstream.netloc  # what the engine believes its own Host is
        self.upstream_origin = f"{upstream.scheme}://{upstream.netloc}"
        self._host_header = (b"host", self.upstream_host.encode("latin-1"))

    # -- which Host the listener answers (DNS rebinding) ------------------------------------
    def listen_host(self) -> str | None:
        return self.tenant.listen.rpartition(":")[0] if self.tenant.listen else None

    def host_policy(self) -> HostPolicy:
        """Loopback, the listener's own address and the tenant's allowed_hosts (see proxy/hosts.py).
        The engine gets its own Host from the proxy, so whatever it checks itself no longer applies."""
        return listener_policy(self.listen_host(), self.tenant.allowed_hosts)

    # -- classification -------------------------------------------------------------------
    def classify(self, method: str, path: str) -> RequestKind:
        return "gpu" if method.upper() in ("POST", "PUT") else "passthrough"

    def unload_target(self, path: str, body: bytes) -> str | None:
        """The model a GPU-route request only unloads (it loads nothing and needs no memory), if any."""
        return None

    # -- headers --------------------------------------------------------------------------
    def upstream_headers(self, headers: Sequence[Header], *, client_ip: str | None, scheme: str,
                         websocket: bool = False) -> list[Header]:
        """The request headers to send upstream: hop-by-hop stripped, Host/Origin per engine,
        X-Forwarded-* appended. Names lower-case (ASGI's); `scheme` is the client-facing one
        (http, https, ws, wss)."""
        client_host = b""
        prior: list[bytes] = []
        out: list[Header] = [self._host_header]
        for name, value in strip_hop_by_hop(headers):
            if name == b"host":
                client_host = value
            elif name in FORWARDED:
                if name == b"x-forwarded-for":
                    prior.append(value)
            elif websocket and name in WS_HANDSHAKE and name != b"origin":
                continue
            elif name == b"origin":
                out.append((name, self.rewrite_origin(value.decode("latin-1"), client_host.decode("latin-1"),
                                                      scheme).encode("latin-1")))
            else:
                out.append((name, value))
        if client_ip:
            prior.append(client_ip.encode("latin-1"))
        if prior:
            out.append((b"x-forwarded-for", b", ".join(prior)))
        out.append((b"x-forwarded-proto", b"https" if scheme in ("https", "wss") else b"http"))
        if client_host:
            out.append((b"x-forwarded-host", client_host))
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

    def queue_path(self) -> str | None:
        """Where the engine lists the jobs it still has (None: it does not say)."""
        return None

    def job_ids_from_queue(self, status: int, body: bytes) -> frozenset[str] | None:
        """Every job id the engine's queue answer lists, running or pending; None if unreadable."""
        return None

    def load_seconds(self, answer_tail: bytes) -> float | None:
        """How long the engine says its model load took, from the end of its answer (None: it does not say)."""
        return None

    def drops_jobs(self, method: str, path: str) -> bool:
        """Whether this request can remove queued jobs (a queue delete or clear)."""
        return False
