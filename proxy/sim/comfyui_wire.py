"""Small wire helpers of the simulated ComfyUI: the origin rule, plain-text errors, PNG bytes, multipart."""

from __future__ import annotations

import email.parser
import email.policy
import email.utils
import ipaddress
import struct
import sys
import zlib
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

AIOHTTP_500 = "500 Internal Server Error\n\nServer got itself in trouble"
# aiohttp's SERVER_SOFTWARE: "Python/<major>.<minor> aiohttp/<version>"; 3.13.3 is what 0.8.0-era installs
# resolved (requirements.txt asks aiohttp>=3.11.8).
AIOHTTP_VERSION = "3.13.3"
SERVER_SOFTWARE = f"Python/{sys.version_info[0]}.{sys.version_info[1]} aiohttp/{AIOHTTP_VERSION}"


class AiohttpHeaders:
    """What aiohttp adds to every response it sends: `Date` and `Server` (setdefault), and
    `Content-Type: application/octet-stream` on a response with a body that set none. An empty
    answer (Content-Length 0: ComfyUI's `web.Response()` of /free, /interrupt, /settings...) gets no
    Content-Type: a real ComfyUI 0.8.0 and a minimal aiohttp app of either version send none there
    (issue 36), nor on HEAD, 1xx, 204 or 304. A streamed answer (the static route's missing file)
    cannot be known empty when its head is sent and keeps the default. The websocket upgrade's 101
    carries Date and Server too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        head = scope["type"] == "http" and scope["method"] == "HEAD"

        async def send_with_headers(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                status = message.get("status", 101)
                empty = head or status < 200 or status in (204, 304) or (b"content-length", b"0") in (
                    (k.lower(), v.strip()) for k, v in headers)
                if message["type"] == "http.response.start" and not empty and b"content-type" not in names:
                    headers.append((b"content-type", b"application/octet-stream"))
                if b"date" not in names:
                    headers.append((b"date", email.utils.formatdate(usegmt=True).encode()))
                if b"server" not in names:
                    headers.append((b"server", SERVER_SOFTWARE.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _is_loopback(hostname: str) -> bool:
    """ComfyUI resolves the name; the simulator only knows literal loopback IPs and localhost names
    (no DNS lookups from a test server)."""
    name = hostname.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def origin_rejected(host: str | None, origin: str | None) -> bool:
    """create_origin_only_middleware (v0.3.64): loopback Host with a different Origin host[:port]."""
    if not host or not origin:
        return False
    host_domain = host.lower()
    parsed_origin = urlsplit(origin)
    origin_domain = parsed_origin.netloc.lower()
    parsed_host = urlsplit("//" + host)
    host_name = parsed_host.hostname or ""
    try:
        origin_port, host_port = parsed_origin.port, parsed_host.port
    except ValueError:
        return False
    if origin_port is None:
        host_domain = host_name
    if host_port is None:
        origin_domain = parsed_origin.hostname or ""
    return _is_loopback(host_name) and bool(host_domain) and bool(origin_domain) and host_domain != origin_domain


class OriginAndSizeMiddleware:
    """The default origin_only_middleware (its 403, then OPTIONS answered 200 before any route) plus
    aiohttp's client_max_size (413 by Content-Length)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if origin_rejected(headers.get("host"), headers.get("origin")):
            if scope["type"] == "websocket":
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})  # before accept: uvicorn answers 403
            else:
                await _plain(send, 403, b"")
            return
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            await _plain(send, 200, b"")  # answered by the middleware, whatever the path
            return
        if scope["type"] == "http":
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body_bytes:
                await _plain(send, 413, (f"Maximum request body size {self.max_body_bytes} exceeded, "
                                         f"actual body size {int(length)}").encode())
                return
        await self.app(scope, receive, send)


async def _plain(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if body:
        headers.append((b"content-type", b"text/plain; charset=utf-8"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def png_bytes(width: int = 8, height: int = 8, rgb: int = 0x336699) -> bytes:
    """A valid solid-colour PNG (small: the simulator never writes real resolutions)."""
    pixel = bytes(((rgb >> 16) & 255, (rgb >> 8) & 255, rgb & 255))
    raw = b"".join(b"\x00" + pixel * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


# A minimal JPEG-looking payload for preview frames (SOI ... EOI); clients only check framing.
FAKE_JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9"


@dataclass(frozen=True, slots=True)
class FormPart:
    name: str
    filename: str | None
    data: bytes


def parse_multipart(content_type: str, body: bytes) -> dict[str, FormPart]:
    """multipart/form-data without python-multipart: the stdlib MIME parser is enough for uploads."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n" + body)
    parts: dict[str, FormPart] = {}
    if not message.is_multipart():
        return parts
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        filename = part.get_filename()
        data = part.get_payload(decode=True) or b""
        parts[name] = FormPart(name, filename, data if isinstance(data, bytes) else bytes(data))
    return parts
