"""A container the proxy stops and starts (release kind `docker`), through the Docker Engine API on
its Unix socket (`/var/run/docker.sock`, or Podman's compatible socket): no docker CLI needed.

Calls (Engine API, unversioned paths, which the daemon serves as its own version):
  POST /containers/{id}/start      204 started, 304 already running, 404 no such container
  POST /containers/{id}/stop?t=N   204 stopped, 304 already stopped, 404; the daemon sends the
                                   container's stop signal, then SIGKILL after N seconds
  GET  /containers/{id}/json       200 with State.Running (and State.Paused), 404
Errors come as `{"message": "..."}`. A container running when the proxy starts is adopted; at
shutdown it is left running.

Every call is bounded: a start by the tenant's `start_timeout_s`, a stop by its `t` plus
REQUEST_TIMEOUT_S, an inspect (status, health) by STATUS_TIMEOUT_S. A daemon that accepts and never
answers is an error that says so, not a wait.
"""

from __future__ import annotations

import math
import os
import re
from typing import Literal
from urllib.parse import quote

import httpx
from pydantic import Field, field_validator

from proxy.config.schema import Tenant
from proxy.lifecycle.controller import (
    DEFAULT_STOP_TIMEOUT_S,
    JSON,
    ControllerTools,
    Exit,
    LifecycleController,
    LifecycleError,
    Status,
    StoppingRelease,
    shown,
    stop_timeout_field,
)

DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"

REQUEST_TIMEOUT_S = 30.0  # beyond the stop's own t=N
STATUS_TIMEOUT_S = 10.0  # an inspect: the daemon answers at once when it is well


class DockerController:
    kind = "docker"

    def __init__(self, container: str, socket: str = DEFAULT_DOCKER_SOCKET, *,
                 stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S, transport: httpx.AsyncBaseTransport | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, start_timeout_s: float | None = None,
                 status_timeout_s: float | None = None) -> None:
        self.container = container
        self.socket = os.path.expanduser(socket)
        self.stop_timeout_s = stop_timeout_s
        self.request_timeout_s = request_timeout_s
        self.start_timeout_s = min(start_timeout_s, request_timeout_s) if start_timeout_s else request_timeout_s
        self.status_timeout_s = min(status_timeout_s or STATUS_TIMEOUT_S, request_timeout_s)
        self._client = httpx.AsyncClient(transport=transport or httpx.AsyncHTTPTransport(uds=self.socket),
                                         base_url="http://docker", timeout=request_timeout_s, trust_env=False)
        self._path = f"/containers/{quote(container, safe='')}"
        self._last_error: str | None = None

    @classmethod
    def from_spec(cls, spec: DockerRelease, *, transport: httpx.AsyncBaseTransport | None = None,
                  start_timeout_s: float | None = None) -> DockerController:
        if spec.container is None:
            raise ValueError(f"release kind {spec.kind!r} has no container")
        return cls(spec.container, spec.effective_socket, stop_timeout_s=spec.effective_stop_timeout_s,
                   transport=transport, start_timeout_s=start_timeout_s)

    def _unreachable(self, exc: Exception) -> LifecycleError:
        if not os.path.exists(self.socket):
            fix = (f"no socket at {self.socket}: start Docker (`systemctl start docker`), or point release.socket at "
                   "Podman's (`systemctl --user enable --now podman.socket`, then $XDG_RUNTIME_DIR/podman/podman.sock)")
        elif not os.access(self.socket, os.R_OK | os.W_OK):
            fix = f"the proxy's user may not use {self.socket}: add it to the socket's group (usually `docker`)"
        else:
            fix = f"check that the Docker daemon behind {self.socket} runs (`systemctl status docker`)"
        return LifecycleError(f"cannot reach the Docker Engine API at {self.socket}: {str(exc) or type(exc).__name__}",
                              fix=fix)

    def _silent(self, method: str, path: str, timeout_s: float) -> LifecycleError:
        return LifecycleError(
            f"the Docker Engine API at {self.socket} did not answer {method} {self._path + path} within {timeout_s:g} s",
            fix=f"check the daemon behind {self.socket} (`systemctl status docker`, `docker info`): it accepts "
                "connections but does not answer")

    async def _call(self, method: str, path: str, *, limit_s: float, params: dict[str, int] | None = None) -> httpx.Response:
        try:
            return await self._client.request(method, self._path + path, timeout=limit_s, params=params)
        except httpx.TimeoutException as exc:
            error = self._silent(method, path, limit_s) if not isinstance(exc, httpx.ConnectTimeout) \
                else self._unreachable(exc)
            self._last_error = error.message
            raise error from None
        except httpx.TransportError as exc:
            error = self._unreachable(exc)
            self._last_error = error.message
            raise error from None

    def _refused(self, what: str, r: httpx.Response) -> LifecycleError:
        if r.status_code == 404:
            return LifecycleError(f"no such container: {self.container!r} (Docker at {self.socket})",
                                  fix="check release.container in tenants.json against `docker ps -a`; "
                                      "create the container first (the proxy starts and stops it, never creates it)")
        try:
            message = str(r.json().get("message") or r.text)
        except ValueError:
            message = r.text
        return LifecycleError(f"Docker refused to {what} container {self.container!r}: {r.status_code} {message[:300]}",
                              fix=f"see `docker logs --tail 50 {self.container}`")

    async def _act(self, what: str, path: str, *, limit_s: float, params: dict[str, int] | None = None) -> None:
        r = await self._call("POST", path, limit_s=limit_s, params=params)
        if r.status_code not in (204, 304):  # 304: already started / already stopped
            error = self._refused(what, r)
            self._last_error = error.message
            raise error
        self._last_error = None

    async def start(self) -> None:
        await self._act("start", "/start", limit_s=self.start_timeout_s)

    async def stop(self) -> None:
        t = math.ceil(self.stop_timeout_s)
        await self._act("stop", "/stop", params={"t": t}, limit_s=t + self.request_timeout_s)

    async def _inspect(self) -> dict[str, object]:
        r = await self._call("GET", "/json", limit_s=self.status_timeout_s)
        if r.status_code != 200:
            raise self._refused("inspect", r)
        data = r.json()
        return data if isinstance(data, dict) else {}

    async def status(self) -> Status:
        try:
            state = (await self._inspect()).get("State")
        except (LifecycleError, ValueError):
            return "unknown"
        running = isinstance(state, dict) and bool(state.get("Running") or state.get("Paused"))
        return "running" if running else "stopped"

    def describe(self) -> JSON:
        return shown(LifecycleController(kind="docker", container=self.container, socket=self.socket, error=self._last_error))

    def summary(self) -> str:
        return f"docker container {self.container} at {self.socket}"

    def output_elsewhere(self) -> tuple[str, str] | None:
        return "docker container", "`docker logs -f <container>`"

    def output(self) -> tuple[str, ...]:
        return ()

    def exited(self) -> str | None:
        return None

    async def wait_exit(self) -> Exit | None:
        return None  # no child to wait for: the liveness probe finds a unit or container that ended

    async def clean_up(self) -> list[str]:
        return []  # adopted as it is, never ended

    async def check(self) -> list[str]:
        try:
            await self._inspect()
        except LifecycleError as exc:
            return [exc.one_line().removeprefix("error: ")]
        except ValueError:
            return [f"the Docker Engine API at {self.socket} answered no JSON for container {self.container!r}"]
        return []

    async def aclose(self) -> None:
        """Closes the connection; the container is left as it is (the next proxy adopts it)."""
        await self._client.aclose()


# Docker container names and ids ([a-zA-Z0-9][a-zA-Z0-9_.-]+, or hex): safe in a URL path as they are.
CONTAINER_NAME = re.compile(r"/?[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


class DockerRelease(StoppingRelease):
    """Release kind `docker`: a container stopped and started through the Engine API."""

    kind: Literal["docker"] = "docker"
    stop_timeout_s: float | None = stop_timeout_field()
    container: str | None = Field(default=None, validate_default=True, description="kind docker: container name or id")
    socket: str | None = Field(default=None, description=f"kind docker: the Engine API's Unix socket "
                                                         f"(default {DEFAULT_DOCKER_SOCKET}; Podman's works too)")

    @field_validator("container")
    @classmethod
    def _container(cls, value: str | None) -> str | None:
        if value is None:
            raise ValueError("release kind 'docker' needs 'container'")
        if not CONTAINER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a container name or id (letters, digits, '_', '.', '-')")
        return value.lstrip("/")

    @field_validator("socket")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("/", "~")) or "\0" in value):
            raise ValueError(f"expected an absolute path, got {value!r}")
        return value

    @property
    def effective_stop_timeout_s(self) -> float:
        return DEFAULT_STOP_TIMEOUT_S if self.stop_timeout_s is None else self.stop_timeout_s

    @property
    def effective_socket(self) -> str:
        return self.socket or DEFAULT_DOCKER_SOCKET

    def controller(self, tenant: Tenant, tools: ControllerTools) -> DockerController:
        return DockerController.from_spec(self, transport=tools.docker_transport, start_timeout_s=tenant.start_timeout_s)
