"""The simulated ComfyUI's user data and settings routes, as app/user_manager.py and app/app_settings.py
serve them to the web UI (workflow save, listing and loading; the settings file).

Single-user mode (no --multi-user): every request is user "default", whose files live in
`<base>/user/default`. Status codes, texts and JSON shapes follow the source; see proxy/sim/README.md.
"""

from __future__ import annotations

import glob
import json
import mimetypes
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

SETTINGS_FILE = "comfy.settings.json"
Handler = Callable[[Request], Awaitable[Response]]


class BadJson(Exception):
    """A body `await request.json()` cannot load (or a merge that raises): aiohttp's plain 500."""


class EmptyStreamed(Response):
    """An aiohttp response prepared without a length (a FileResponse that sets its status after a failed
    stat): no Content-Length, so HTTP/1.1 streams its empty body chunked."""

    def __init__(self, status: int) -> None:
        super().__init__(status_code=status)
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json; charset=utf-8")


def _text(text: str, status: int) -> Response:
    return PlainTextResponse(text, status_code=status)  # web.Response(text=...): text/plain; charset=utf-8


def _file_info(path: str, relative_to: str) -> dict[str, Any]:
    """get_file_info(): times are os.path.getmtime()/getctime() floats, in seconds."""
    return {"path": os.path.relpath(path, relative_to).replace(os.sep, "/"), "size": os.path.getsize(path),
            "modified": os.path.getmtime(path), "created": os.path.getctime(path)}


def raw_segment(request: Request, route: str) -> str | None:
    """The `{file}` of an aiohttp route `<route>/{file}`: one raw path segment (a `%2F` inside it is
    fine, a literal `/` is another path no route takes), percent-decoded as aiohttp decodes match_info.
    None where aiohttp's route would not match."""
    raw = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
    marker = route + "/"
    at = raw.find(marker)
    if at < 0:
        return None
    rest = raw[at + len(marker):]
    if not rest or "/" in rest:
        return None
    return unquote(rest)


class UserData:
    def __init__(self, user_directory: Path) -> None:
        self.root = os.path.abspath(user_directory)
        self.user_root = os.path.abspath(os.path.join(self.root, "default"))

    def filepath(self, file: str | None, create_dir: bool = True) -> str | None:
        """get_request_user_filepath(): None for a path leaving the user's directory; makes the
        parent directory (create_dir) as the real one does, even for a read."""
        path = self.user_root
        if file is not None:
            if "%" in file:  # "Check if filename is url encoded": a second decoding
                file = unquote(file)
            path = os.path.abspath(os.path.join(self.user_root, file))
            if os.path.commonpath((self.user_root, path)) != self.user_root:
                return None
        parent = os.path.split(path)[0]
        if create_dir and not os.path.exists(parent):
            os.makedirs(parent, exist_ok=True)
        return path

    # -- /userdata ---------------------------------------------------------------------------------

    async def list(self, request: Request) -> Response:
        return self._list(request.query_params)

    def _list(self, query: Any) -> Response:
        directory = query.get("dir", "")
        if not directory:
            return _text("Directory not provided", 400)
        path = self.filepath(directory)
        if not path:
            return _text("Invalid directory", 403)
        if not os.path.exists(path):
            return _text("Directory not found", 404)
        recurse = query.get("recurse", "").lower() == "true"
        full_info = query.get("full_info", "").lower() == "true"
        split_path = query.get("split", "").lower() == "true"
        pattern = os.path.join(glob.escape(path), "**", "*") if recurse else os.path.join(glob.escape(path), "*")

        def entry(full_path: str) -> Any:
            if full_info:
                return _file_info(full_path, path)
            rel_path = os.path.relpath(full_path, path).replace(os.sep, "/")
            return [rel_path, *rel_path.split("/")] if split_path else rel_path

        return _json([entry(p) for p in glob.glob(pattern, recursive=recurse) if os.path.isfile(p)])

    def _data_path(self, file: str, check_exists: bool) -> str | Response:
        path = self.filepath(file)
        if not path:
            return Response(status_code=403)
        if check_exists and not os.path.exists(path):
            return Response(status_code=404)
        return path

    async def get(self, request: Request, file: str) -> Response:
        return self._get(file)

    def _get(self, file: str) -> Response:
        path = self._data_path(file, check_exists=True)
        if not isinstance(path, str):
            return path
        stat = os.stat(path)
        if not os.path.isfile(path):
            return EmptyStreamed(403)  # FileResponse on a non-regular file: 403, empty
        response = FileResponse(path, stat_result=stat)
        # aiohttp's FileResponse: the guessed type as it is (no charset added), its own ETag form.
        response.headers["content-type"] = mimetypes.guess_type(path)[0] or "application/octet-stream"
        response.headers["etag"] = f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
        return response

    async def post(self, request: Request, file: str) -> Response:
        path = self._data_path(file, check_exists=False)
        if not isinstance(path, str):
            return path
        overwrite = request.query_params.get("overwrite", "true") != "false"
        if not overwrite and self._exists(path):
            return _text("File already exists", 409)
        return self._write(path, await request.body(),
                           request.query_params.get("full_info", "false").lower() == "true")

    @staticmethod
    def _exists(path: str) -> bool:
        return os.path.exists(path)

    def _write(self, path: str, body: bytes, full_info: bool) -> Response:
        try:
            with open(path, "wb") as f:
                f.write(body)
        except OSError:
            # web.Response(status=400, reason="Invalid filename. ..."): empty body, the text in the reason
            return Response(status_code=400)
        user_path = self.filepath(None)
        assert user_path is not None
        return _json(_file_info(path, user_path) if full_info else os.path.relpath(path, user_path))

    async def delete(self, request: Request, file: str) -> Response:
        return self._delete(file)

    def _delete(self, file: str) -> Response:
        path = self._data_path(file, check_exists=True)
        if not isinstance(path, str):
            return path
        try:
            os.remove(path)
        except OSError as exc:  # a directory: the exception escapes the handler
            raise BadJson() from exc
        return Response(status_code=204)

    # -- /settings ---------------------------------------------------------------------------------

    def _settings(self) -> Any:
        file = self.filepath(SETTINGS_FILE)
        assert file is not None
        if not os.path.isfile(file):
            return {}
        try:
            with open(file) as f:
                return json.load(f)
        except (OSError, ValueError):  # "The user settings file is corrupted"
            return {}

    def _save(self, settings: Any) -> None:
        file = self.filepath(SETTINGS_FILE)
        assert file is not None
        with open(file, "w") as f:
            f.write(json.dumps(settings, indent=4))

    async def get_settings(self, request: Request) -> Response:
        return _json(self._settings())

    async def get_setting(self, request: Request, setting_id: str) -> Response:
        settings = self._settings()
        return _json(settings[setting_id] if setting_id in settings else None)

    async def post_settings(self, request: Request) -> Response:
        settings = self._settings()
        new_settings = await _request_json(request)
        try:
            merged = {**settings, **new_settings}
        except TypeError as exc:
            raise BadJson() from exc
        self._save(merged)
        return Response(status_code=200)

    async def post_setting(self, request: Request, setting_id: str) -> Response:
        settings = self._settings()
        settings[setting_id] = await _request_json(request)
        self._save(settings)
        return Response(status_code=200)


async def _request_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise BadJson() from exc
