"""Pure wire helpers for the Ollama simulator: keep_alive parsing, Go time formats, digests,
embeddings, the Host and Origin checks. No I/O, no clock: callers pass the time in.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import posixpath
import re
import socket
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

FOREVER_S = math.inf
# Go's time.Duration(math.MaxInt64): what "forever" shows as in /api/ps (about 292 years ahead).
GO_MAX_DURATION_S = (2**63 - 1) / 1e9

_UNITS_S = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0,
            "m": 60.0, "h": 3600.0}
_UNIT_RE = re.compile(r"([0-9]*(?:\.[0-9]*)?)([^0-9.]*)")


class KeepAliveError(ValueError):
    """A keep_alive value Ollama rejects with 400; the message is Go's, verbatim."""


def parse_go_duration(text: str) -> float:
    """time.ParseDuration, in seconds (negative stays negative). Raises KeepAliveError with Go's text."""
    quoted = json.dumps(text, ensure_ascii=False)
    s = text
    sign = 1.0
    if s[:1] in ("-", "+"):
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if s == "":
        raise KeepAliveError(f"time: invalid duration {quoted}")
    total = 0.0
    while s:
        m = _UNIT_RE.match(s)
        number, unit = (m.group(1), m.group(2)) if m else ("", "")
        if number in ("", "."):
            raise KeepAliveError(f"time: invalid duration {quoted}")
        if unit == "":
            raise KeepAliveError(f"time: missing unit in duration {quoted}")
        # the unit runs until the next digit or dot
        if unit not in _UNITS_S:
            raise KeepAliveError(f"time: unknown unit {json.dumps(unit, ensure_ascii=False)} in duration {quoted}")
        total += float(number) * _UNITS_S[unit]
        s = s[len(number) + len(unit):]
    return sign * total


def _go_type_name(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, list):
        return "[]interface {}"
    if isinstance(value, dict):
        return "map[string]interface {}"
    return type(value).__name__


def parse_keep_alive(value: object) -> float | None:
    """The request's keep_alive in seconds; None when absent/null, inf for forever (any negative)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise KeepAliveError(f"Unsupported type: '{_go_type_name(value)}'")
    seconds = parse_go_duration(value) if isinstance(value, str) else float(value)
    return FOREVER_S if seconds < 0 else seconds


def parse_keep_alive_env(text: str) -> float:
    """OLLAMA_KEEP_ALIVE rules: like a request string, but a bare integer is seconds too."""
    try:
        seconds = float(int(text))
    except ValueError:
        seconds = parse_go_duration(text)
    return FOREVER_S if seconds < 0 else seconds


# -- time formats ---------------------------------------------------------------------------------

def rfc3339_nano(unix_s: float, *, local: bool) -> str:
    """Go's RFC3339Nano: fraction with trailing zeros trimmed, "Z" for UTC, else +hh:mm."""
    try:
        dt = datetime.fromtimestamp(unix_s, tz=UTC)
    except (OverflowError, OSError, ValueError):
        dt = datetime(9999, 12, 31, tzinfo=UTC)
    if local:
        dt = dt.astimezone()
    out = dt.strftime("%Y-%m-%dT%H:%M:%S")
    frac = f"{dt.microsecond:06d}".rstrip("0")
    if frac:
        out += "." + frac
    offset = dt.utcoffset() or timedelta(0)
    if offset == timedelta(0):
        return out + "Z"
    minutes = int(offset.total_seconds() // 60)
    sign = "+" if minutes >= 0 else "-"
    minutes = abs(minutes)
    return f"{out}{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# -- names, digests, vectors ----------------------------------------------------------------------

def normalise_name(name: str) -> str:
    """"llama3.2" -> "llama3.2:latest" (Ollama's default tag); names compare case-insensitively."""
    base = name.strip()
    last = base.rsplit("/", 1)[-1]
    return base if ":" in last else f"{base}:latest"


def qualified_name(name: str) -> str:
    """model.Name.String(): registry host and namespace filled in ("registry.ollama.ai/library/m:latest")."""
    parts = normalise_name(name).split("/")
    defaults = ["registry.ollama.ai", "library"]
    return "/".join(defaults[: max(0, 3 - len(parts))] + parts)


def model_digest(name: str) -> str:
    """64 hex, deterministic from the name (the manifest digest shown by /api/tags)."""
    return hashlib.sha256(f"manifest:{normalise_name(name)}".encode()).hexdigest()


def blob_digest(name: str) -> str:
    return hashlib.sha256(f"blob:{normalise_name(name)}".encode()).hexdigest()


def embedding(model: str, text: str, dims: int) -> list[float]:
    """A deterministic L2-normalised float32-ish vector for (model, text)."""
    values: list[float] = []
    counter = 0
    seed = f"{model}\x00{text}".encode()
    while len(values) < dims:
        block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        counter += 1
        for (word,) in struct.iter_unpack(">I", block):
            values.append(word / 2**31 - 1.0)
    values = values[:dims]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [float(struct.unpack("f", struct.pack("f", v / norm))[0]) for v in values]


# -- Host and Origin checks (A.1) -----------------------------------------------------------------

_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


def _split_host(host: str) -> str:
    """net.SplitHostPort, falling back to the whole value when there is no port."""
    if host.startswith("["):
        end = host.find("]")
        if end > 0 and (host[end + 1:] == "" or host[end + 1:].startswith(":")):
            return host[1:end] if host[end + 1:] else host
        return host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def host_allowed(host_header: str) -> bool:
    """allowedHostsMiddleware for a loopback listener (local interface IPs other than loopback not checked)."""
    host = _split_host(host_header)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None:
        if addr.is_loopback or addr.is_unspecified or any(addr in net for net in _PRIVATE_NETS
                                                          if net.version == addr.version):
            return True
    host = host.lower()
    if host in ("", "localhost") or host == socket.gethostname().lower():
        return True
    return any(host.endswith("." + tld) for tld in ("localhost", "local", "internal"))


_DEFAULT_ORIGINS = (
    *(f"{scheme}://{h}{port}" for h in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)
_EXTENSION_SCHEMES = ("chrome-extension://", "safari-extension://", "moz-extension://", "ms-browser-extension://")


def _origin_matches(origin: str, pattern: str) -> bool:
    if pattern == "*":
        return True
    if "*" not in pattern:
        return origin == pattern
    prefix, _, suffix = pattern.partition("*")
    return len(origin) >= len(prefix) + len(suffix) and origin.startswith(prefix) and origin.endswith(suffix)


def origin_allowed(origin: str, extra: tuple[str, ...]) -> bool:
    if origin.startswith(_EXTENSION_SCHEMES):
        return True
    return any(_origin_matches(origin, p.strip()) for p in (*extra, *_DEFAULT_ORIGINS) if p.strip())


CORS_ALLOW_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, OpenAI-Beta, x-stainless-*"
CORS_ALLOW_METHODS = "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"


# -- gin's RedirectTrailingSlash (v1.10) ------------------------------------------------------------

_UNSAFE_PREFIX = re.compile(r"[^a-zA-Z0-9/-]+")
_REPEATED_SLASH = re.compile(r"/{2,}")
_HTML_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;", "'": "&#39;"})


@dataclass(frozen=True, slots=True)
class Redirect:
    status: int
    location: str
    content_type: str | None
    body: bytes


def _go_clean(path: str) -> str:
    """Go's path.Clean ("" is ".", a rooted path keeps one leading slash)."""
    return posixpath.normpath(_REPEATED_SLASH.sub("/", path)) if path else "."


def trailing_slash_redirect(method: str, path: str, query: str, forwarded_prefix: str) -> Redirect:
    """What gin answers for /api/tags/ when only /api/tags is routed (for this method): a redirect to
    the path without the slash, 301 for GET and 307 for every other method (HEAD too), written by
    net/http's Redirect (an HTML body for GET only). X-Forwarded-Prefix, cleaned, goes in front."""
    prefix = _go_clean(forwarded_prefix)
    target = path
    if prefix != ".":
        target = _REPEATED_SLASH.sub("/", _UNSAFE_PREFIX.sub("", prefix)) + "/" + path
    target = target[:-1] if len(target) > 1 and target.endswith("/") else target + "/"
    trailing = target.endswith("/")
    target = _go_clean(target) + ("/" if trailing and target != "/" else "")  # Redirect cleans, keeps a slash
    location = target + (f"?{query}" if query else "")
    status = 301 if method == "GET" else 307
    content_type = "text/html; charset=utf-8" if method in ("GET", "HEAD") else None
    body = f'<a href="{location.translate(_HTML_ESCAPES)}">Moved Permanently</a>.\n\n'.encode() if method == "GET" else b""
    return Redirect(status, location, content_type, body)


def dumps(obj: Any) -> bytes:
    """Compact JSON like Go's encoding/json."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
