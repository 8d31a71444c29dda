"""How a tenant gives its memory back: one release step, and `release` as one step or a list."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from proxy.config.fields import HttpCall, HttpMethod, StrictModel

ReleaseKind = Literal["ollama_unload", "comfyui_free", "http", "none", "process", "systemd", "docker"]
# The kinds that release a tenant by stopping it, and so can start it again (proxy/lifecycle/).
LIFECYCLE_KINDS = frozenset({"process", "systemd", "docker"})
DEFAULT_STOP_TIMEOUT_S = 10.0  # process: SIGTERM, then SIGKILL after this; docker: `stop?t=`
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"

# Fields that belong to some release kinds only, and the kinds that need them. A field named for
# another kind is refused at its own path, so a typo in `kind` cannot silently drop a command.
KIND_FIELDS: Mapping[str, frozenset[str]] = {
    "resume": frozenset({"http"}),
    "command": frozenset({"process"}),
    "stop_command": frozenset({"process"}),
    "cwd": frozenset({"process"}),
    "env": frozenset({"process"}),
    "stop_timeout_s": frozenset({"process", "docker"}),
    "unit": frozenset({"systemd"}),
    "scope": frozenset({"systemd"}),
    "container": frozenset({"docker"}),
    "socket": frozenset({"docker"}),
}
REQUIRED_FIELDS: Mapping[str, str] = {"command": "process", "unit": "systemd", "container": "docker"}

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# systemd unit names (systemd.unit(5)): no leading '-', so a name can never read as an option.
UNIT_NAME = re.compile(r"[A-Za-z0-9_:.\\@][A-Za-z0-9_:.\\@-]{0,254}")
# Docker container names and ids ([a-zA-Z0-9][a-zA-Z0-9_.-]+, or hex): safe in a URL path as they are.
CONTAINER_NAME = re.compile(r"/?[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


class ReleaseSpec(StrictModel):
    """How to ask the tenant for its memory back (one step, when `release` is a list of steps).

    The lifecycle kinds (`process`, `systemd`, `docker`) release by stopping the app, and start it
    again when a request arrives for it (proxy/lifecycle/)."""

    kind: ReleaseKind = Field(
        default="none", description="how the memory is asked back: ollama_unload (every loaded model with keep_alive 0), "
        "comfyui_free (POST /free), http (a call you configure), process, systemd or docker (stop the app, start it again "
        "on its next request), or none (not reclaimable: a release answers 409 with the reason)")
    reason: str | None = Field(default=None, description="kind none: why it cannot be released (shown in 409s)")
    method: HttpMethod = Field(default="POST", description="kind http: the HTTP method")
    url: str | None = Field(default=None, description="kind http: absolute URL, or a path on the upstream")
    body: dict[str, Any] | None = Field(default=None, description="kind http: JSON body to send")
    unload_models: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to unload its models")
    free_memory: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to free its cached memory too")
    timeout_s: float | None = Field(
        default=None, description="how long this step may take until the card shows the memory back; "
                                  "null: the tenant's release_timeout_s")
    resume: HttpCall | None = Field(default=None, description="kind http: the call that wakes the app before its next "
                                                               "request is forwarded (vLLM's /wake_up)")
    command: list[str] | None = Field(default=None, validate_default=True,
                                      description="kind process: the command the proxy runs and owns, argv style")
    stop_command: list[str] | None = Field(
        default=None, description="kind process: a command run to stop the app instead of signals, argv style (like "
        "llama-swap's cmdStop: [\"docker\", \"stop\", \"tts\"]); it and the app's exit share stop_timeout_s, it "
        "is killed with its process group when it runs over, and SIGTERM then SIGKILL follow when it fails or the "
        "app still runs")
    cwd: str | None = Field(default=None, description="kind process: its working directory (absolute)")
    env: dict[str, str] | None = Field(default=None, description="kind process: added to the proxy's environment")
    stop_timeout_s: float | None = Field(
        default=None, description=f"kinds process and docker: SIGTERM, then SIGKILL after this long "
                                  f"(default {DEFAULT_STOP_TIMEOUT_S:g})")
    unit: str | None = Field(default=None, validate_default=True, description="kind systemd: the unit, like comfyui.service")
    scope: Literal["system", "user"] | None = Field(
        default=None, description="kind systemd: the system manager (default) or the user's (`systemctl --user`)")
    container: str | None = Field(default=None, validate_default=True, description="kind docker: container name or id")
    socket: str | None = Field(default=None, description=f"kind docker: the Engine API's Unix socket "
                                                         f"(default {DEFAULT_DOCKER_SOCKET}; Podman's works too)")

    @field_validator(*KIND_FIELDS)
    @classmethod
    def _for_its_kind(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        field = info.field_name or ""
        if kind is None:  # the kind itself is wrong: that error is enough
            return value
        if value is None:
            if REQUIRED_FIELDS.get(field) == kind:
                raise ValueError(f"release kind {kind!r} needs {field!r}")
            return value
        if kind not in KIND_FIELDS[field]:
            kinds = " or ".join(repr(k) for k in sorted(KIND_FIELDS[field]))
            raise ValueError(f"only release kind {kinds} takes {field!r} (this release is kind {kind!r})")
        return value

    @field_validator("command", "stop_command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value or not value[0]:
            raise ValueError("expected the program and its arguments, like [\"llama-server\", \"--port\", \"8081\"]")
        if any("\0" in arg for arg in value):
            raise ValueError("an argument contains a NUL character")
        if "/" in value[0] and not value[0].startswith("/"):
            raise ValueError(f"{value[0]!r}: give the program as an absolute path or a bare name found on PATH")
        return value

    @field_validator("cwd", "socket")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("/", "~")) or "\0" in value):
            raise ValueError(f"expected an absolute path, got {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, inner in (value or {}).items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not an environment variable name (letters, digits, '_')")
            if "\0" in inner:
                raise ValueError(f"{key!r}: the value contains a NUL character")
        return value

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str | None) -> str | None:
        if value is not None and not UNIT_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a systemd unit name (like comfyui.service)")
        return value

    @field_validator("container")
    @classmethod
    def _container(cls, value: str | None) -> str | None:
        if value is not None and not CONTAINER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a container name or id (letters, digits, '_', '.', '-')")
        return value.lstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _http_needs_url(self) -> ReleaseSpec:
        if self.kind == "http" and not self.url:
            raise ValueError("release kind 'http' needs a 'url' (absolute, or a path on the upstream)")
        return self

    @property
    def stops(self) -> bool:
        """This step stops the app (and so the proxy can start it again)."""
        return self.kind in LIFECYCLE_KINDS

    @property
    def effective_stop_timeout_s(self) -> float:
        return DEFAULT_STOP_TIMEOUT_S if self.stop_timeout_s is None else self.stop_timeout_s

    @property
    def effective_scope(self) -> Literal["system", "user"]:
        return self.scope or "system"

    @property
    def effective_socket(self) -> str:
        return self.socket or DEFAULT_DOCKER_SOCKET


# Tags of the two shapes `release` takes; messages.problems leaves them out of an error's path.
ONE_STEP, STEPS = "(one release)", "(release steps)"


def _release_shape(value: Any) -> str:
    return STEPS if isinstance(value, list) else ONE_STEP


Release = Annotated[Annotated[ReleaseSpec, Tag(ONE_STEP)] | Annotated[list[ReleaseSpec], Tag(STEPS)],
                    Discriminator(_release_shape)]
