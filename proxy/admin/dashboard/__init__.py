"""The dashboard: one static page on the admin listener (`/`, `/static/{path}`), no build step, no CDN.

The page reads everything live from the admin API (`/api/events`, `/api/health`, `/api/engines`) and
releases through `POST /api/tenants/{name}/release`; nothing here computes state. Files are read from
the package once, at start, so a page load never touches the disk.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.proxy_view import ProxyView

MEDIA_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page is served from the admin origin only; no inline scripts, no third-party origins.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def load_static() -> dict[str, bytes]:
    """Every shipped static file by name (flat directory), with a known media type."""
    root = resources.files(__package__).joinpath("static")
    out: dict[str, bytes] = {}
    if not root.is_dir():  # an install without the package data: the API still works, / says why
        return out
    for entry in root.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in MEDIA_TYPES:
            out[entry.name] = entry.read_bytes()
    return out


def _media_type(name: str) -> str:
    return MEDIA_TYPES["." + name.rsplit(".", 1)[-1]]


class DashboardExtension:
    def __init__(self, proxy: ProxyView) -> None:
        self.proxy = proxy
        self.files: dict[str, bytes] = load_static()

    def routes(self) -> list[BaseRoute]:
        return [Route("/", self.index, methods=["GET"]),
                Route("/static/{path}", self.static, methods=["GET"])]

    async def index(self, request: Request) -> Response:
        if "index.html" not in self.files:
            return JSONResponse({"error": "the dashboard's files are not installed (proxy/dashboard/static/)",
                                 "fix": "reinstall hyperswap from a source that ships its package data"}, status_code=503)
        return Response(self.files["index.html"], media_type=_media_type("index.html"),
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP})

    async def static(self, request: Request) -> Response:
        name = request.path_params["path"]
        body = self.files.get(name)
        if body is None:
            return JSONResponse({"error": f"no dashboard file {name!r}", "fix": "open / for the dashboard"}, status_code=404)
        return Response(body, media_type=_media_type(name), headers={"Cache-Control": "no-cache"})

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def dashboard_extension(proxy: ProxyView) -> DashboardExtension:
    return DashboardExtension(proxy)
