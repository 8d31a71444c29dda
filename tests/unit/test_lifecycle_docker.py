"""DockerController against a fake Docker Engine API served on a Unix socket (starlette under uvicorn)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.clock import SystemClock
from proxy.engines.loading import registry_from_dict
from proxy.lifecycle import DockerController, LifecycleError, controller_for
from proxy.tasks import poll_until


@dataclass
class Engine:
    """The containers the fake daemon knows (name -> running) and the calls it got."""

    running: dict[str, bool] = field(default_factory=lambda: {"tts": False})
    calls: list[str] = field(default_factory=list)

    def app(self) -> Starlette:
        def known(request: Request) -> str | None:
            name = request.path_params["name"]
            return name if name in self.running else None

        async def act(request: Request) -> Response:
            self.calls.append(f"{request.method} {request.url.path}?{request.url.query}")
            name = known(request)
            if name is None:
                return JSONResponse({"message": f"No such container: {request.path_params['name']}"}, 404)
            want = request.path_params["verb"] == "start"
            if self.running[name] == want:
                return Response(status_code=304)
            self.running[name] = want
            return Response(status_code=204)

        async def inspect(request: Request) -> Response:
            self.calls.append(f"GET {request.url.path}")
            name = known(request)
            if name is None:
                return JSONResponse({"message": f"No such container: {request.path_params['name']}"}, 404)
            return JSONResponse({"Name": f"/{name}", "State": {"Running": self.running[name], "Paused": False}})

        return Starlette(routes=[Route("/containers/{name}/{verb:str}", act, methods=["POST"]),
                                 Route("/containers/{name}/json", inspect, methods=["GET"])])


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, Path]]:
    fake = Engine()
    sock = tmp_path / "docker.sock"
    server = uvicorn.Server(uvicorn.Config(fake.app(), uds=str(sock), lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        await poll_until(lambda: server.started)
    yield fake, sock
    server.should_exit = True
    await task


async def test_start_stop_and_status_through_the_engine_api(engine: tuple[Engine, Path]) -> None:
    fake, sock = engine
    reg = registry_from_dict({"tenants": {"tts": {"upstream": "http://127.0.0.1:5002", "release": {
        "kind": "docker", "container": "tts", "socket": str(sock), "stop_timeout_s": 2.5}}}})
    ctl = controller_for(reg.get("tts"), clock=SystemClock())
    assert isinstance(ctl, DockerController)
    try:
        assert await ctl.status() == "stopped"
        await ctl.start()
        await ctl.start()  # 304: already started is no error
        assert await ctl.status() == "running" and fake.running["tts"]
        await ctl.stop()
        await ctl.stop()  # 304: already stopped
        assert await ctl.status() == "stopped"
        assert await ctl.check() == []
    finally:
        await ctl.aclose()
    assert fake.calls == ["GET /containers/tts/json", "POST /containers/tts/start?", "POST /containers/tts/start?",
                          "GET /containers/tts/json", "POST /containers/tts/stop?t=3", "POST /containers/tts/stop?t=3",
                          "GET /containers/tts/json", "GET /containers/tts/json"]


async def test_no_such_container_is_a_clear_error(engine: tuple[Engine, Path]) -> None:
    _, sock = engine
    ctl = DockerController("speech", str(sock))
    try:
        with pytest.raises(LifecycleError) as err:
            await ctl.start()
        assert err.value.message == f"no such container: 'speech' (Docker at {sock})"
        assert err.value.fix is not None and "docker ps -a" in err.value.fix
        assert await ctl.status() == "unknown"
        problems = await ctl.check()
        assert problems and problems[0].startswith("no such container: 'speech'")
    finally:
        await ctl.aclose()


async def test_a_missing_socket_is_a_clear_error_with_the_fix(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    ctl = DockerController("tts", str(sock))
    try:
        with pytest.raises(LifecycleError) as err:
            await ctl.stop()
        assert err.value.message.startswith(f"cannot reach the Docker Engine API at {sock}")
        assert err.value.fix is not None and "systemctl start docker" in err.value.fix and "podman.socket" in err.value.fix
        assert await ctl.status() == "unknown"
        assert ctl.describe()["error"] == err.value.message
    finally:
        await ctl.aclose()
